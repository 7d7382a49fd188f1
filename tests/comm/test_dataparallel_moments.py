"""``engine: {type: dataparallel, exchange: moments}`` on 4 simulated devices against a float64
NumPy reference: per-replica Max-AdaBelief recursions on each shard's gradient, m̂ and s_max
averaged; ``exchange: gradients`` against the same recursion on the averaged gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxstream.experiment.checkpoints import ArmCheckpointer
from jaxstream.experiment.compiled import engine_for
from jaxstream.experiment.engine_dataparallel import DataParallelEngineConfig, MomentExchangeEngine
from jaxstream.experiment.optimizers import OptimizerConfig
from jaxstream.experiment.train_config import ArmConfig, TrainConfig
from tests.trees import max_rel_err

N, B, D, C, STEPS, LR = 4, 16, 6, 3, 3, 0.05
OPTIONS = {"b1": 0.8, "b2": 0.9, "eps": 1e-8, "eps_root": 1e-12}


def _loss(p, b):
    logits = b["x"] @ p["w"] + p["b"]
    picked = jnp.take_along_axis(logits, b["y"][:, None], -1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def _np_grad(p, x, y):
    """Float64 gradient of the mean softmax cross-entropy of a linear model."""
    logits = x @ p["w"] + p["b"]
    e = np.exp(logits - logits.max(-1, keepdims=True))
    dl = (e / e.sum(-1, keepdims=True) - np.eye(C)[y]) / len(y)
    return {"b": dl.sum(0), "w": x.T @ dl}


def _reference(params, batches, exchange):
    """Params after each step: Max-AdaBelief (max_of raw) per replica, m̂ and s_max averaged;
    with ``exchange="gradients"`` every replica sees the averaged gradient instead."""
    b1, b2, eps, eps_root = (OPTIONS[k] for k in ("b1", "b2", "eps", "eps_root"))
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m, s, s_max = ({k: np.zeros((N, *v.shape)) for k, v in p.items()} for _ in range(3))
    out = []
    for t, batch in enumerate(batches, start=1):
        x, y = np.asarray(batch["x"], np.float64), np.asarray(batch["y"])
        g = [_np_grad(p, x[i * B // N : (i + 1) * B // N], y[i * B // N : (i + 1) * B // N])
             for i in range(N)]
        for k, pk in p.items():
            gk = np.stack([gi[k] for gi in g])
            if exchange == "gradients":
                gk = np.broadcast_to(gk.mean(0), gk.shape)
            m[k] = b1 * m[k] + (1 - b1) * gk
            s[k] = b2 * s[k] + (1 - b2) * (gk - m[k]) ** 2 + eps_root
            s_max[k] = np.maximum(s_max[k], s[k])
            m_hat = (m[k] / (1 - b1**t)).mean(0)
            s_hat = (s_max[k] / (1 - b2**t)).mean(0)
            p[k] = pk - LR * m_hat / (np.sqrt(s_hat) + eps)
        out.append({k: v.copy() for k, v in p.items()})
    return out


def _config(exchange="moments", allreduce="psum", optimizer="max_adabelief", arm_opt=None):
    return TrainConfig(
        steps=STEPS,
        batch_size=B,
        engine=DataParallelEngineConfig(devices=N, allreduce=allreduce, exchange=exchange),
        optimizer=OptimizerConfig(name=optimizer, options=dict(OPTIONS)),
        arms=(ArmConfig(name="bp", lr=LR, optimizer=arm_opt),),
    )


def _engine(cfg):
    return engine_for(cfg, cfg.arms[0], _loss)  # the runner's path (backprop arm)


def _problem():
    rng = np.random.default_rng(0)
    params = {"b": jnp.zeros(C), "w": jnp.asarray(rng.normal(size=(D, C)) * 0.3, jnp.float32)}
    # Shards drawn from different distributions: the replicas' gradients differ.
    shift = np.repeat(np.arange(N), B // N)[:, None] * 0.5
    batches = [
        {"x": jnp.asarray(rng.normal(size=(B, D)) + shift, jnp.float32),
         "y": jnp.asarray(rng.integers(0, C, size=B), jnp.int32)}
        for _ in range(STEPS)
    ]
    return params, batches


@pytest.mark.parametrize("exchange,allreduce", [("moments", "ring"), ("gradients", "psum")])
def test_engine_matches_float64_reference(exchange, allreduce):
    params, batches = _problem()
    engine = _engine(_config(exchange, allreduce))
    assert isinstance(engine, MomentExchangeEngine) == (exchange == "moments")
    state = engine.init(params, None)
    expected = _reference(params, batches, exchange)
    other = _reference(params, batches, "gradients" if exchange == "moments" else "moments")
    for t, batch in enumerate(batches):
        loss = _loss(engine.params(state), batch)
        state, metrics = engine.step(state, batch, jax.random.key(t))
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
        err = max_rel_err(engine.params(state), expected[t])
        assert err <= 1e-5, f"step {t}: max relative error {err:.3g}"
    assert max_rel_err(expected[-1], other[-1]) > 1e-2  # the two exchanges differ here
    assert engine.step._cache_size() == 1


def test_checkpoint_holds_every_replica_and_resumes(tmp_path):
    params, batches = _problem()
    engine = _engine(_config("moments", "psum"))
    state = engine.init(params, None)
    for t, batch in enumerate(batches[:2]):
        state, _ = engine.step(state, batch, jax.random.key(t))
    mu = state.opt_state[0].mu["w"]
    assert mu.shape == (N, D, C) and mu.sharding.spec == P("data")
    assert float(jnp.max(jnp.abs(mu[0] - mu[1]))) > 1e-3  # the replicas' states differ
    ckpt = ArmCheckpointer(tmp_path / "ckpt")
    ckpt.save(2, state)
    step, restored, _ = ckpt.restore_latest(engine.init(params, None))
    ckpt.close()
    assert step == 2
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    resumed, _ = engine.step(restored, batches[2], jax.random.key(2))
    straight, _ = engine.step(state, batches[2], jax.random.key(2))
    assert max_rel_err(engine.params(resumed), engine.params(straight)) == 0.0
    assert engine.step._cache_size() == 1  # the restored state reuses the compiled step


def test_moments_refuse_other_optimizers_before_compute():
    with pytest.raises(ValueError, match=r"engine.exchange: 'moments' needs optimizer.name in "
                                         r"\('max_adabelief',\), got 'adam'"):
        _config(optimizer="adam")
    with pytest.raises(ValueError, match=r"needs arms.0.optimizer.name in .*got 'sgd'"):
        _config(arm_opt=OptimizerConfig(name="sgd"))
    with pytest.raises(ValueError, match=r"exchange: 'pmean' is not allowed; choose one of "
                                         r"'gradients', 'scalars', 'moments'"):
        DataParallelEngineConfig(exchange="pmean")
    _config(exchange="gradients", optimizer="adam")  # any optimizer with a gradient all-reduce
