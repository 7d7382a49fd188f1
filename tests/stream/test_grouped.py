"""Grouped units (``layers_per_unit``): G consecutive layers read together and run on the
device as one scanned program give the one-layer sweeps' gradients and steps — the forward
estimator's and backprop's, against in memory — and every other plan is refused by name."""

from __future__ import annotations

import jax
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.registry import load_experiment
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from tests.local_problem import local_problem
from tests.trees import max_rel_err


def _problem():
    return local_problem(False, depth=5, micro_batches=2)


@pytest.mark.parametrize("group", [2, 5])
@pytest.mark.parametrize("name", ["forward", "backprop"])
def test_grouped_units_equal_in_memory(tmp_path, name, group):
    """Depth 5 in units of 2 (2 + 2 + 1: the last unit shorter) or of all 5: the estimate
    equals the in-memory estimator's, a step moves the store by one SGD step of it, and the
    step reads each layer once per sweep as one-layer units do."""
    stack, params, micro, flat = _problem()
    est = jg.forward(2) if name == "forward" else jg.backprop()
    key = jax.random.key(4)
    _, ref = est(stack, params, flat, key)
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    ex = StreamedExecutor(stack, est, optax.sgd(0.1), store,
                          StreamConfig(compute_dtype="float32", prefetch=1,
                                       layers_per_unit=group))
    assert [len(u.layers) for u in ex.placement.chunks(list(range(5)))] == (
        [2, 2, 1] if group == 2 else [5])
    _, grads = ex.estimate(micro, key)
    assert max_rel_err(grads, ref) <= 1e-5
    metrics = ex.step(micro, key)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, ref)
    assert max_rel_err(store.read_params(), want) <= 1e-5
    one = LayerStore.create(tmp_path / "one", jax.device_get(params), optimizer=optax.sgd(0.1))
    single = StreamedExecutor(stack, est, optax.sgd(0.1), one,
                              StreamConfig(compute_dtype="float32", prefetch=1))
    # every block once per sweep; backprop's reverse starts on the forward's last unit,
    # resident (one layer, or the whole last group, not read again)
    last = 1 if group == 2 else 5
    assert single.step(micro, key)["layers_read"] == (10 if name == "forward" else 9)
    assert metrics["layers_read"] == (10 if name == "forward" else 10 - last)
    store.close()
    one.close()


@pytest.mark.parametrize("est", [jg.hybrid(1), jg.forward(perturb="activations"),
                                 jg.exact_subset(1)], ids=["hybrid", "activity", "subset"])
def test_other_plans_are_refused_by_name(tmp_path, est):
    stack, params, _, _ = _problem()
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"stream: layers_per_unit=2 runs the forward estimator "
                                         r"with weight tangents and backprop, not .*; allowed "
                                         r"for it: 1"):
        StreamedExecutor(stack, est, optax.sgd(0.1), store, StreamConfig(layers_per_unit=2))
    with pytest.raises(ValueError, match="layers_per_unit must be an int >= 1, got 0"):
        StreamConfig(layers_per_unit=0)
    assert store.step == 0


def test_yaml_layers_per_unit_is_checked_per_arm_before_any_run():
    base = {"kind": "train", "model": {"type": "mlp", "depth": 4},
            "engine": {"type": "stream", "layers_per_unit": 2}}
    _, cfg = load_experiment({**base, "arms": [{"name": "fg", "estimator": {"type": "forward"}},
                                               {"name": "bp", "estimator": {"type": "backprop"}}]})
    assert cfg.engine.layers_per_unit == 2
    assert cfg.engine.units(4) == (4, "embed, 2 units of up to 2 blocks, head")
    with pytest.raises(ConfigError, match=r"arms.0.estimator: stream: layers_per_unit=2 runs "
                                          r"the forward estimator"):
        load_experiment({**base, "arms": [{"name": "h", "estimator": {
            "type": "hybrid", "micro_batches": 2}}]})
    with pytest.raises(ConfigError, match="engine.layers_per_unit: the composed engine"):
        load_experiment({**base, "engine": {"type": "composed", "stage": 2,
                                            "layers_per_unit": 2},
                         "arms": [{"name": "bp", "estimator": {"type": "backprop"}}]})
