"""Data parallelism and a model's own randomness: shard s draws its dropout masks from
``fold_in(rng, s)`` (the single-device estimator on each shard with that key bound, averaged);
a model with batch statistics (BatchNorm) is refused by name before any compute."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import jaxstream as js
import jaxstream.grad as jg
from jaxstream.comm import data_parallel
from tests.trees import assert_trees_close

S, N, B, D = 4, 2, 4, 16  # shards, micro-batches, rows per shard (of a micro-batch), width
RNG, KEY = jax.random.key(5), jax.random.key(1)


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:S]), ("data",))


def dropout_model():
    """Dropout(0.5) -> Linear (kernel ones, no bias), loss out[:, 0], bound to RNG."""
    rngs = nnx.Rngs(0)
    linear = nnx.Linear(D, 1, use_bias=False, rngs=rngs)
    linear.kernel[...] = jnp.ones((D, 1))
    model = js.models.from_sequential(nnx.Sequential(nnx.Dropout(0.5, rngs=rngs), linear),
                                      loss=lambda out, batch: out[:, 0])
    return model.with_rng(RNG)


def mean_tree(trees):
    return jax.tree.map(lambda *g: sum(g) / len(g), *trees)


def test_backprop_shards_draw_their_own_masks(mesh):
    model = dropout_model()
    params = model.init(None)
    batch = {"x": jnp.ones((S * B, D)), "y": jnp.zeros((S * B,))}
    _, g = jax.jit(data_parallel(jg.backprop(), mesh), static_argnums=0)(
        model, params, batch, KEY)
    shard = lambda s: jax.tree.map(lambda x: x[s * B:(s + 1) * B], batch)
    ref = mean_tree([jax.grad(model.with_rng(jax.random.fold_in(RNG, s)))(params, shard(s))
                     for s in range(S)])
    assert_trees_close(g, ref, rtol=1e-6)


def test_hybrid_shards_draw_their_own_masks(mesh):
    """Every micro-batch exact, tangents shared (the per-micro-batch quantities reduced over
    the shards): the mean of the single-device hybrid on each shard with fold_in(rng, s)."""
    model = dropout_model()
    params = model.init(None)
    micro = {"x": jnp.ones((N, S * B, D)), "y": jnp.zeros((N, S * B))}
    est = jg.hybrid(num_exact=N)
    dp = data_parallel(est, mesh, batch_axis=1, tangents="shared")
    _, g = jax.jit(dp, static_argnums=0)(model, params, micro, KEY)
    shard = lambda s: jax.tree.map(lambda x: x[:, s * B:(s + 1) * B], micro)
    ref = mean_tree([est(model.with_rng(jax.random.fold_in(RNG, s)), params, shard(s), KEY)[1]
                     for s in range(S)])
    assert_trees_close(g, ref, rtol=1e-6)


def test_batch_norm_model_is_refused_by_name(mesh):
    rngs = nnx.Rngs(0)
    model = js.models.from_sequential(nnx.Sequential(
        nnx.Linear(8, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs), nnx.tanh,
        nnx.Linear(16, 3, rngs=rngs)))
    params = model.init(None)
    batch = {"x": jnp.ones((S * B, 8)), "y": jnp.zeros((S * B,), jnp.int32)}
    with pytest.raises(ValueError, match=r"layer 1: BatchNorm.*run this model on one device"):
        data_parallel(jg.backprop(), mesh)(model, params, batch, KEY)
    dp = data_parallel(jg.backprop(), mesh, exchange="moments")
    with pytest.raises(ValueError, match=r"layer 1: BatchNorm"):
        dp.step(model, optax.sgd(0.1), params, None, batch, KEY)
