"""The pipeline training engine and its experiment configs."""

from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.experiment.engine_pipeline import PipelineEngine, PipelineEngineConfig
from jaxstream.experiment.engines import split_micro_batches
from jaxstream.experiment.estimators import BackpropConfig, HybridConfig
from jaxstream.experiment.registry import load_experiment
from jaxstream.models import mlp

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["pipeline_mlp.yaml", "pipeline_transformer.yaml"])
def test_shipped_configs_parse(name):
    kind, cfg = load_experiment(ROOT / "experiments" / name)
    assert kind == "train" and isinstance(cfg.engine, PipelineEngineConfig)
    assert cfg.model.depth % cfg.engine.stages == 0


def test_bad_engine_options_name_the_field():
    with pytest.raises(ValueError, match="policy: 'bogus' is not allowed; choose one of"):
        PipelineEngineConfig(policy="bogus")
    with pytest.raises(ValueError, match="stages: must be >= 1, got 0"):
        PipelineEngineConfig(stages=0)
    with pytest.raises(ValueError, match="estimator.exact_from"):
        PipelineEngine(PipelineEngineConfig(stages=2), stack=mlp(4, 4, 2, 3),
                       estimator=jg.hybrid(exact_from=(0, 1, 3, 3)), optimizer=optax.sgd(0.1),
                       micro_batches=4)
    with pytest.raises(ValueError, match="policy='delayed': .* needs example_batch="):
        PipelineEngine(PipelineEngineConfig(stages=2, policy="delayed"), stack=mlp(4, 4, 2, 3),
                       estimator=HybridConfig(micro_batches=4, num_exact=1).build(),
                       optimizer=optax.sgd(0.1), micro_batches=4)


def _batch(seed=1):
    # NumPy data: no eager XLA compilation for the random draws
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((8, 6), dtype=np.float32),
            "y": rng.integers(0, 3, (8,), dtype=np.int32)}


def test_delayed_engine_step_is_pipeline_gradient_plus_optax_update():
    stack = mlp(in_dim=6, width=5, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    batch = _batch()
    eng = PipelineEngine(PipelineEngineConfig(stages=2, policy="delayed"), stack=stack,
                         estimator=HybridConfig(micro_batches=4, num_exact=1).build(),
                         optimizer=optax.sgd(0.1), micro_batches=4, example_batch=batch)
    state = eng.init(params, jax.random.key(0))
    key = jax.random.key(5)
    new, metrics = eng.step(state, batch, key)
    _, grads, _ = eng.pipe(params, split_micro_batches(batch, 4), key, state.carry)
    want = jax.tree.map(lambda p, g: np.asarray(p) - np.float32(0.1) * np.asarray(g), params, grads)
    got = eng.params(new)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.allclose(a, b, atol=1e-6)
    assert float(new.carry.valid) == 1.0 and np.isfinite(float(metrics["loss"]))
    eng.step(new, batch, key)
    assert eng.step._cache_size() == 1  # the carry keeps its structure: no recompilation


def test_backprop_arm_is_exact():
    stack = mlp(in_dim=6, width=5, depth=2, num_classes=3)
    eng = PipelineEngine(PipelineEngineConfig(stages=2, micro_batches=2), stack=stack,
                         estimator=BackpropConfig().build(), optimizer=optax.sgd(1.0))
    params = stack.init(jax.random.key(0))
    batch = _batch()
    loss, grads = eng.estimate(eng.init(params, jax.random.key(0)), batch, jax.random.key(1))
    ref_loss, ref = jax.jit(jax.value_and_grad(stack))(params, batch)
    assert abs(float(loss - ref_loss)) < 1e-6
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        assert np.allclose(a, b, atol=1e-6)


def test_guess_engine_carries_the_exact_mean_to_the_next_step():
    """guess: each step differentiates along the direction in the state (the previous step's
    exact mean) and leaves its own exact mean for the next one."""
    stack = mlp(in_dim=6, width=5, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    batch, batch2 = _batch(1), _batch(2)
    eng = PipelineEngine(PipelineEngineConfig(stages=2, policy="complete"), stack=stack,
                         estimator=jg.hybrid(exact_indices=(0,), correction="guess"),
                         optimizer=optax.sgd(0.1), micro_batches=4, example_batch=batch)
    state = eng.init(params, jax.random.key(0))
    key = jax.random.key(5)
    new, _ = eng.step(state, batch2, key)
    _, grads, aux = eng.pipe(params, split_micro_batches(batch2, 4), key, guess=state.direction)
    want = jax.tree.map(lambda p, g: np.asarray(p) - np.float32(0.1) * np.asarray(g), params, grads)
    for a, b in zip(jax.tree.leaves(eng.params(new)), jax.tree.leaves(want)):
        assert np.allclose(a, b, atol=1e-6)
    for a, b in zip(jax.tree.leaves(new.direction), jax.tree.leaves(aux["direction"])):
        assert np.allclose(a, b, atol=1e-6)
    eng.step(new, batch, key)
    assert eng.step._cache_size() == 1


def test_exact_subset_arm_equals_the_in_memory_estimator():
    """The engine splits the batch into the arm's N micro-batches; the key picks k of them."""
    stack = mlp(in_dim=6, width=5, depth=2, num_classes=3)
    est = jg.exact_subset(2)
    eng = PipelineEngine(PipelineEngineConfig(stages=2), stack=stack, estimator=est,
                         optimizer=optax.sgd(0.1), micro_batches=4)
    params, batch, key = stack.init(jax.random.key(0)), _batch(), jax.random.key(3)
    loss, grads = eng.estimate(eng.init(params, jax.random.key(0)), batch, key)
    ref_loss, ref = est(stack, params, split_micro_batches(batch, 4), key)
    assert abs(float(loss - ref_loss)) < 1e-6
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref)):
        assert np.allclose(a, b, atol=1e-6)
