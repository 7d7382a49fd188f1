"""An optimizer whose initial state depends on the parameters' values (schedule-free's ``z``
starts as the parameters): each block layer's state in a new store is ``optimizer.init`` of
that layer's own parameters, as in memory. The store once broadcast layer 0's state to every
layer, and the streamed blocks then trained 99 % away from ``js.train_step`` after one step."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxstream as js
import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(6, 8, 3, 3)
OPT = optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2)


def test_each_layer_starts_from_its_own_state_and_trains_as_in_memory(tmp_path):
    params = STACK.init(jax.random.key(0))
    store = LayerStore.create(str(tmp_path / "s"), params, optimizer=OPT)
    for l in range(3):  # the reference: optax's own init of the layer
        want = OPT.init(jax.tree.map(lambda a, l=l: a[l], params["blocks"]))
        for g, w in zip(jax.tree.leaves(store.read_opt(l).result()), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((2, 4, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (2, 4)).astype(np.int32)}
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), micro)
    step = js.train_step(jg.backprop(), OPT, STACK)
    p, s = params, step.init(params)
    with StreamedExecutor(STACK, jg.backprop(), OPT, store,
                          StreamConfig(compute_dtype="float32")) as ex:
        for t in range(3):
            key = jax.random.key(t)
            ex.step(micro, key)
            p, s, _ = step(p, s, flat, key)
    got = store.read_params()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


def test_a_store_from_shapes_refuses_an_optimizer_that_reads_values(tmp_path):
    shapes = jax.eval_shape(STACK.init, jax.random.key(0))
    with pytest.raises(ValueError, match="initial state depends on the parameters' values"):
        LayerStore.create(str(tmp_path / "s"), shapes, optimizer=OPT)
    # adam's initial state reads shapes only: allocated from shapes as before
    LayerStore.create(str(tmp_path / "a"), shapes, optimizer=optax.adam(1e-3))


@pytest.mark.parametrize("optimizer, says", [
    (optax.noisy_sgd(0.1, key=jax.random.key(0)), r"keeps a PRNG key in its state"),
    (optax.adamw(1e-3, mask={"embed": True, "blocks": False, "head": True}),
     r"cannot be initialised on the embed's parameters alone"),
])
def test_an_optimizer_a_store_cannot_keep_per_unit_is_refused_before_writing(
        tmp_path, optimizer, says):
    """Refused by name before the store is written (they were 'creating the store failed'
    with a tensorstore or pytree error inside)."""
    with pytest.raises(ValueError, match=says):
        LayerStore.create(str(tmp_path / "s"), STACK.init(jax.random.key(0)),
                          optimizer=optimizer)
    assert not (tmp_path / "s").exists()


def test_a_boolean_optimizer_state_is_kept(tmp_path):
    """apply_if_finite keeps a bool (last_finite): zarr3 wants a bool fill value for it."""
    opt = optax.apply_if_finite(optax.adam(1e-3), 3)
    params = STACK.init(jax.random.key(0))
    store = LayerStore.create(str(tmp_path / "s"), params, optimizer=opt)
    want = opt.init(jax.tree.map(lambda a: a[1], params["blocks"]))
    got = store.read_opt(1).result()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
