"""The local guess (Fournier et al.) on the stream engine: its three sweeps (exact local
gradients, one jvp along them, the update) give the in-memory estimator's gradient, with the
shared head and with a head per block; the composed engine refuses it by name."""

from __future__ import annotations

import jax
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from tests.local_problem import local_problem
from tests.trees import max_rel_err


def _problem(own: bool, depth: int = 3):
    return local_problem(own, depth=depth, micro_batches=2)


@pytest.mark.parametrize("own", [False, True], ids=["shared-head", "own-heads"])
def test_streamed_local_guess_equals_in_memory(tmp_path, own):
    stack, params, micro, flat = _problem(own)
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    ex = StreamedExecutor(stack, jg.local_guess(), optax.sgd(0.1), store,
                          StreamConfig(compute_dtype="float32", prefetch=1))
    key = jax.random.key(3)
    loss, grads = ex.estimate(micro, key)
    ref_loss, ref = jg.local_guess()(stack, params, flat, key)
    assert max_rel_err(grads, ref) <= 1e-5
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    assert store.step == 0  # an estimate commits nothing
    ex.step(micro, key)  # and a step commits: the store moves on by one SGD step
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, ref)
    assert max_rel_err(store.read_params(), want) <= 1e-5


@pytest.mark.parametrize("mesh, own", [((1, 4), False), ((2, 2), True), ((2, 1), False)],
                         ids=["1x4-shared-head", "2x2-own-heads", "2x1-shared-head"])
def test_composed_local_guess_equals_in_memory(tmp_path, mesh, own):
    """Over a data × stage mesh: the exact local gradients as one circular pass over the
    chunk, the jvp along them as another, each replica's share averaged."""
    from jaxstream.compose import ComposedExecutor, make_mesh
    from jaxstream.experiment.registry import load_experiment

    stack, params, micro, flat = _problem(own, depth=4)
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    ex = ComposedExecutor(stack, jg.local_guess(), optax.sgd(0.1), store,
                          StreamConfig(compute_dtype="float32", prefetch=1),
                          mesh=make_mesh(*mesh))
    key = jax.random.key(3)
    loss, grads = ex.estimate(micro, key)
    ref_loss, ref = jg.local_guess()(stack, params, flat, key)
    assert max_rel_err(grads, ref) <= 1e-5
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    load_experiment({"kind": "train", "engine": {"type": "composed", "stage": 2},
                     "model": {"type": "mlp", "depth": 4},
                     "arms": [{"name": "lg", "estimator": {"type": "local_guess"}}]})
