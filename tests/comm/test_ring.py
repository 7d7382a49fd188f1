"""Ring all-reduce equals psum on 2, 4, 8 devices and any length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstream.comm import (
    collectives,
    ring_all_reduce,
    ring_all_reduce_tree,
    ring_wire_bytes,
    traffic_summary,
)


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def _sharded(fn, n):
    return jax.jit(
        shard_map(lambda x: fn(x[0])[None], mesh=_mesh(n), in_specs=P("data"), out_specs=P("data"))
    )


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("length", [1, 7, 16, 37])
def test_ring_equals_psum(n, length):
    x = np.random.default_rng(n * 100 + length).normal(size=(n, length)).astype(np.float32)
    ring = np.asarray(_sharded(lambda v: ring_all_reduce(v, "data"), n)(x))
    psum = np.asarray(_sharded(lambda v: jax.lax.psum(v, "data"), n)(x))
    expected = x.astype(np.float64).sum(0)
    for row_ring, row_psum in zip(ring, psum):
        np.testing.assert_allclose(row_ring, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(row_ring, row_psum, rtol=1e-5, atol=1e-6)


def test_ring_mean_and_integer_sum_exact():
    n = 4
    x = np.arange(n * 10, dtype=np.int32).reshape(n, 10)
    out = np.asarray(_sharded(lambda v: ring_all_reduce(v, "data"), n)(x))
    np.testing.assert_array_equal(out[2], x.sum(0))
    xf = x.astype(np.float32)
    mean = np.asarray(_sharded(lambda v: ring_all_reduce(v, "data", mean=True), n)(xf))
    np.testing.assert_allclose(mean[0], xf.mean(0), rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2])
def test_ring_mean_of_integers_has_pmeans_dtype_on_any_device_count(n):
    x = np.arange(n * 3, dtype=np.int32).reshape(n, 3)
    ring = _sharded(lambda v: ring_all_reduce(v, "data", mean=True), n)(x)
    pmean = _sharded(lambda v: jax.lax.pmean(v, "data"), n)(x)
    assert ring.dtype == pmean.dtype
    np.testing.assert_array_equal(np.asarray(ring), np.asarray(pmean))


def test_ring_tree_keeps_structure_and_dtypes():
    n = 8
    mesh = _mesh(n)
    tree = {
        "a": np.random.default_rng(0).normal(size=(n, 3, 5)).astype(np.float32),
        "b": np.random.default_rng(1).normal(size=(n, 11)).astype(np.float32),
    }
    fn = jax.jit(
        shard_map(
            lambda t: jax.tree.map(
                lambda v: v[None], ring_all_reduce_tree(jax.tree.map(lambda v: v[0], t), "data")
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    out = fn(tree)
    for key, value in tree.items():
        assert out[key].shape == value.shape and out[key].dtype == jnp.float32
        np.testing.assert_allclose(out[key][5], value.sum(0), rtol=1e-5, atol=1e-5)


def test_ring_bytes_counted_from_hlo_match_formula():
    n, length = 8, 37
    x = jnp.ones((n, length), jnp.float32)
    ring = traffic_summary(collectives(_sharded(lambda v: ring_all_reduce(v, "data"), n), x))
    assert ring["collective-permute"] == ring_wire_bytes(length, n, 4) == 2 * 7 * 5 * 4
    assert ring["num_ops"] == 2 * (n - 1)
    psum = traffic_summary(collectives(_sharded(lambda v: jax.lax.psum(v, "data"), n), x))
    assert psum["all-reduce"] == length * 4


def test_ring_on_data_axis_of_2d_mesh():
    """Inside a (data x stage) shard_map the ring reduces over ``data`` only."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "stage"))
    x = np.random.default_rng(5).normal(size=(4, 2, 9)).astype(np.float32)
    fn = jax.jit(
        shard_map(
            lambda v: ring_all_reduce(v[0, 0], "data")[None, None],
            mesh=mesh,
            in_specs=P("data", "stage"),
            out_specs=P("data", "stage"),
        )
    )
    out = np.asarray(fn(x))
    for d in range(4):
        np.testing.assert_allclose(out[d], x.sum(0), rtol=1e-5, atol=1e-6)
