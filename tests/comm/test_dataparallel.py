"""Data-parallel estimates on 8 simulated devices equal single-device whole-batch ones."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxstream.comm import collectives, traffic_summary
from jaxstream.comm.dataparallel import data_parallel, device_keys
from jaxstream.grad import backprop, forward, hybrid
from jaxstream.models import mlp
from tests.trees import assert_trees_close, max_rel_err

N = 8


@pytest.fixture(scope="module")
def setup():
    stack = mlp(in_dim=12, width=16, depth=2, num_classes=5)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(32, 12)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 5, size=32), jnp.int32),
    }
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",))
    return stack, params, batch, mesh


_close = assert_trees_close


@functools.cache
def _jitted(est):
    return jax.jit(est, static_argnums=0)


def _run(est, stack, params, batch, key=None):
    key = jax.random.key(3) if key is None else key
    return _jitted(est)(stack, params, batch, key)


@pytest.mark.parametrize("allreduce", ["psum", "ring"])
def test_backprop_equals_whole_batch(setup, allreduce):
    stack, params, batch, mesh = setup
    loss, grads = _run(data_parallel(backprop(), mesh, allreduce=allreduce), stack, params, batch)
    ref_loss, ref_grads = jax.value_and_grad(stack)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _close(grads, ref_grads)


# exchange="gradients" with shared tangents: tests/test_engine_matrix.py (dataparallel-fwd-w-rad)
@pytest.mark.parametrize("exchange", ["scalars"])
def test_forward_shared_tangents_equal_whole_batch_estimate(setup, exchange):
    stack, params, batch, mesh = setup
    est = forward(num_tangents=2)
    dp = data_parallel(est, mesh, exchange=exchange, tangents="shared")
    loss, grads = _run(dp, stack, params, batch)
    ref_loss, ref_grads = _run(est, stack, params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _close(grads, ref_grads)


@pytest.mark.parametrize("exchange", ["gradients", "scalars"])
def test_forward_independent_tangents_equal_mean_of_shards(setup, exchange):
    stack, params, batch, mesh = setup
    key = jax.random.key(7)
    est = forward(num_tangents=2)
    dp = data_parallel(est, mesh, exchange=exchange)
    loss, grads = _run(dp, stack, params, batch, key)
    keys = device_keys(key, N)
    shards = [jax.tree.map(lambda a, i=i: a[i * 4 : (i + 1) * 4], batch) for i in range(N)]
    per = [_run(est, stack, params, s, k) for s, k in zip(shards, keys)]
    ref_grads = jax.tree.map(lambda *g: sum(g) / N, *[g for _, g in per])
    np.testing.assert_allclose(loss, np.mean([float(l) for l, _ in per]), rtol=1e-5)
    _close(grads, ref_grads)


def _linear_loss(p, b):
    logits = b["x"] @ p["w"] + p["b"]
    picked = jnp.take_along_axis(logits, b["y"][:, None], -1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


LINEAR = {"w": jnp.linspace(-0.3, 0.3, 60).reshape(12, 5), "b": jnp.zeros(5)}


@pytest.mark.parametrize("correction", ["control_variate", "weighted", "guess"])
def test_hybrid_shared_tangents_equal_whole_batch_estimate(setup, correction):
    """The replicas reduce the per-micro-batch scalars and exact gradients, then correct once:
    equal to the whole-batch hybrid, nonlinear corrections (weighted, guess) included."""
    _, _, batch, mesh = setup
    micro = jax.tree.map(lambda a: a.reshape(4, 8, *a.shape[1:]), batch)  # N=4 micro-batches
    est = hybrid(num_exact=2, correction=correction, num_tangents=2)
    dp = data_parallel(est, mesh, tangents="shared", batch_axis=1, allreduce="ring")
    loss, grads = _run(dp, _linear_loss, LINEAR, micro)
    ref_loss, ref_grads = _run(est, _linear_loss, LINEAR, micro)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _close(grads, ref_grads)


def test_generic_pytree_loss_fn(setup):
    _, _, batch, mesh = setup
    est = data_parallel(backprop(), mesh, allreduce="ring")
    loss, grads = _run(est, _linear_loss, LINEAR, batch)
    np.testing.assert_allclose(loss, _linear_loss(LINEAR, batch), rtol=1e-5)
    _close(grads, jax.grad(_linear_loss)(LINEAR, batch))


def test_scalar_exchange_moves_only_scalars(setup):
    stack, params, batch, mesh = setup
    num_params = sum(x.size for x in jax.tree.leaves(params))
    key = jax.random.key(0)

    def traffic(est):
        fn = jax.jit(lambda p, b, k: est(stack, p, b, k))
        return traffic_summary(collectives(fn, params, batch, key, num_devices=N))

    bp = traffic(data_parallel(backprop(), mesh))
    fw = traffic(data_parallel(forward(num_tangents=2), mesh, exchange="scalars"))
    assert bp["all-reduce"] >= 4 * num_params
    assert fw["all-reduce"] + fw["all-gather"] <= 4 * (N * 2 + 2)


def test_bad_options_are_clear_errors(setup):
    stack, params, batch, mesh = setup
    with pytest.raises(ValueError, match="allreduce"):
        data_parallel(backprop(), mesh, allreduce="tree")
    with pytest.raises(ValueError, match="exchange: 'scalars' needs"):
        data_parallel(backprop(), mesh, exchange="scalars")
    with pytest.raises(ValueError, match="not a mesh axis"):
        data_parallel(backprop(), mesh, axis="batch")
    odd = jax.tree.map(lambda a: a[:30], batch)
    with pytest.raises(ValueError, match="divisible by the 8 devices"):
        data_parallel(backprop(), mesh)(stack, params, odd, jax.random.key(0))
    # a hybrid's micro-batches split over the devices would be another estimator: refused
    with pytest.raises(ValueError, match=r"batch_axis: 0 would split Hybrid's micro-batches.*"
                                         r"use batch_axis=1"):
        data_parallel(hybrid(num_exact=2), mesh)
    with pytest.raises(ValueError, match=r"batch_axis: 2 is not an axis of the batch's leaf of "
                                         r"shape \(32, 12\)"):
        data_parallel(backprop(), mesh, batch_axis=2)(stack, params, batch, jax.random.key(0))


def test_explicit_2d_mesh_data_axis(setup):
    """On a (data x stage) explicit-sharding mesh the batch is split over ``data`` only."""
    stack, params, batch, _ = setup
    mesh = jax.make_mesh((4, 2), ("data", "stage"))
    est = data_parallel(backprop(), mesh, allreduce="ring")
    loss, grads = _run(est, stack, params, batch)
    ref_loss, ref_grads = jax.value_and_grad(stack)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _close(grads, ref_grads)


@pytest.mark.parametrize(
    "kw",
    [{"distribution": "rademacher"}, {"distribution": "gaussian", "orthogonal": True,
                                      "local_losses": True}],
    ids=["rademacher", "gaussian-orthogonal-local"],
)
def test_activity_shared_tangents_equal_whole_batch_estimate(setup, kw):
    """Activity tangents are per example: each replica draws the whole batch's and keeps its
    rows, so 4 replicas give the in-memory whole-batch estimate for the same key."""
    stack, params, batch, _ = setup
    n, key = 4, jax.random.key(3)
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    est = forward(num_tangents=2, perturb="activations", **kw)
    dp = data_parallel(est, mesh, tangents="shared", allreduce="ring")
    loss, grads = _run(dp, stack, params, batch, key)
    ref_loss, ref_grads = _run(est, stack, params, batch, key)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _close(grads, ref_grads)
    if kw.get("local_losses"):
        return
    # Not an identity: shard-shaped draws with the same key (the replicas' tangents repeated
    # from shard to shard) give another estimate.
    parts = jax.tree.map(lambda a: a.reshape(n, -1, *a.shape[1:]), batch)
    per = jax.jit(jax.vmap(lambda b: est(stack, params, b, key)[1]))(parts)
    assert max_rel_err(jax.tree.map(lambda g: g.mean(0), per), ref_grads) > 0.1
