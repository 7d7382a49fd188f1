"""Max-AdaBelief moment exchange on 4 simulated devices against a float64 NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import shard_map
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstream.optim import max_adabelief, max_adabelief_exchange

N, STEPS, LR = 4, 6, 0.1
KW = {"b1": 0.8, "b2": 0.9, "eps": 1e-8, "eps_root": 1e-12}
SHAPES = {"b": (5,), "w": (3, 4)}


def _grads(same: bool = False) -> dict[str, np.ndarray]:
    """(STEPS, N, ...) gradients: a shared signal plus per-replica noise of shrinking scale."""
    rng = np.random.default_rng(0)
    out = {}
    for name, shape in SHAPES.items():
        signal = rng.normal(size=(STEPS, 1, *shape))
        noise = rng.normal(size=(STEPS, 1 if same else N, *shape))
        scale = np.linspace(2.0, 0.2, STEPS).reshape(STEPS, 1, *[1] * len(shape))
        out[name] = np.broadcast_to(signal + scale * noise, (STEPS, N, *shape)).copy()
    return out


def _reference(g, b1, b2, eps, eps_root, exchange):
    """Float64 NumPy: (params per step, m per replica at the end) for one leaf g (STEPS, N, ...)."""
    params = np.zeros(g.shape[2:])
    m, s, s_max = (np.zeros(g.shape[1:]) for _ in range(3))
    if not exchange:  # all-reduce the gradient, then one Max-AdaBelief
        g = np.broadcast_to(g.mean(1, keepdims=True), g.shape)
    out = []
    for t, gt in enumerate(g, start=1):
        m = b1 * m + (1 - b1) * gt
        s = b2 * s + (1 - b2) * (gt - m) ** 2 + eps_root
        s_max = np.maximum(s_max, s)
        m_hat = (m / (1 - b1**t)).mean(0)
        s_hat = (s_max / (1 - b2**t)).mean(0)
        params = params - LR * m_hat / (np.sqrt(s_hat) + eps)
        out.append(params.copy())
    return np.stack(out), m


def _run(opt, grads, dtype, exchange_grads: bool):
    """STEPS jitted steps in shard_map over 4 devices; params of every replica and final states."""
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",))
    params = {k: jnp.zeros(s, dtype) for k, s in SHAPES.items()}
    state = jax.tree.map(lambda x: jnp.stack([x] * N), opt.init(params))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = jax.device_put(state, NamedSharding(mesh, P("data")))

    def body(params, state, g):
        state, g = jax.tree.map(lambda x: x[0], (state, g))
        if exchange_grads:
            g = jax.lax.pmean(g, "data")
        updates, state = opt.update(g, state, params)
        new = optax.apply_updates(params, updates)
        return new, *jax.tree.map(lambda x: x[None], (new, state))

    step = jax.jit(
        shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P("data"), P("data")),
            check_vma=False,
        )
    )
    trajectory = []
    for t in range(STEPS):
        g = {k: jnp.asarray(v[t], dtype) for k, v in grads.items()}
        params, stacked, state = step(params, state, g)
        trajectory.append(stacked)  # every replica's params
    assert step._cache_size() == 1
    return trajectory, state


def _rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("allreduce", ["psum", "ring"])
@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("float64", 1e-12)])
def test_exchange_matches_float64_reference(allreduce, dtype, rtol):
    grads = _grads()
    with jax.enable_x64(dtype == "float64"):
        opt = max_adabelief_exchange(LR, **KW, allreduce=allreduce)
        trajectory, state = _run(opt, grads, getattr(jnp, dtype), exchange_grads=False)
    for name, g in grads.items():
        expected, m = _reference(g, **KW, exchange=True)
        for t, stacked in enumerate(trajectory):
            for replica in range(N):  # every replica applies the same update
                assert _rel(stacked[name][replica], expected[t]) < rtol
        # The moments stay per replica: replica i holds the m of its own gradients.
        assert _rel(state[0].mu[name], m) < rtol
        assert np.max(np.abs(m[0] - m[1])) > 0.1


def test_differs_from_gradient_allreduce_unless_gradients_agree():
    for same in (False, True):
        grads = _grads(same)
        got = {}
        for label, opt, exchange_grads in (
            ("moments", max_adabelief_exchange(LR, **KW), False),
            ("gradients", max_adabelief(LR, **KW), True),
        ):
            trajectory, _ = _run(opt, grads, jnp.float32, exchange_grads)
            got[label] = trajectory[-1]
        for name, g in grads.items():
            ref_moments = _reference(g, **KW, exchange=True)[0][-1]
            ref_gradients = _reference(g, **KW, exchange=False)[0][-1]
            assert _rel(got["moments"][name][0], ref_moments) < 1e-5
            assert _rel(got["gradients"][name][0], ref_gradients) < 1e-5
            gap = _rel(got["moments"][name][0], got["gradients"][name][0])
            if same:
                assert gap < 1e-5
            else:
                assert gap > 0.05  # the references differ as much: not a rounding effect
                assert _rel(ref_moments, ref_gradients) > 0.05


def test_corrected_nesterov_equals_max_adabelief_when_gradients_agree():
    grads = _grads(same=True)
    kw = {**KW, "max_of": "corrected", "nesterov": True}
    moments, _ = _run(max_adabelief_exchange(LR, **kw, allreduce="ring"), grads, jnp.float32, False)
    single, _ = _run(max_adabelief(LR, **kw), grads, jnp.float32, False)
    for name in SHAPES:
        assert _rel(moments[-1][name], np.asarray(single[-1][name], np.float64)) < 1e-5


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="allreduce: 'tree' is not allowed"):
        max_adabelief_exchange(LR, allreduce="tree")
    with pytest.raises(ValueError, match="axis_name"):
        max_adabelief_exchange(LR, axis_name="")
    with pytest.raises(ValueError, match="max_of"):
        max_adabelief_exchange(LR, max_of="both")
