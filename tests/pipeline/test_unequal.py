"""Stages of unequal size, placed from device speeds or by layer type: the split is the best
contiguous one (brute force), and the pipeline over it gives the sequential model's gradient."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.pipeline import gpipe_backprop, gpipe_forward, unequal_stages
from jaxstream.pipeline.executor import pipeline
from jaxstream.placement import evaluate_split, place_by_type, place_stages, type_times


def brute(times: np.ndarray) -> float:
    """The least slowest-stage time over every contiguous split (written out, no DP)."""
    m, n = times.shape
    best = np.inf
    for cuts in itertools.combinations(range(1, n), m - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(times[s, bounds[s]:bounds[s + 1]].sum() for s in range(m)))
    return best


def test_placement_by_layer_type_is_the_best_split():
    """Random models of dense / conv / activation layers on mixed device kinds: the split's
    slowest stage equals brute force's, and it beats the count-even split where they differ."""
    rng = np.random.default_rng(0)
    kinds, types = ("gpu", "cpu", "npu"), ("dense", "conv", "activation")
    rate = {(k, t): float(r) for (k, t), r in zip(itertools.product(kinds, types),
                                                   rng.uniform(0.5, 8.0, 9))}
    for _ in range(60):
        n, m = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        m = min(m, n)
        layer_types = list(rng.choice(types, n))
        work = rng.uniform(0.1, 5.0, n)
        devices = list(rng.choice(kinds, m))
        got = place_by_type(layer_types, work, devices, rate)
        times = type_times(layer_types, work, devices, rate)
        assert got.slowest == pytest.approx(brute(times), rel=1e-12)
        assert got.slowest == pytest.approx(max(evaluate_split(times, got.sizes).stage_times))
    with pytest.raises(ValueError, match=r"throughput\[\('tpu', 'dense'\)\]"):
        place_by_type(["dense"], [1.0], ["tpu"], rate)


def test_speed_placement_balances_modelled_devices():
    """Devices of speeds 1, 1, 2, 4 and equal layers: the placement gives the fast devices
    more layers, and its slowest stage over the mean is lower than the even split's."""
    from jaxstream.placement import uniform_placement

    costs, speeds = np.ones(16), (1.0, 1.0, 2.0, 4.0)
    even, placed = uniform_placement(costs, speeds), place_stages(costs, speeds)
    assert placed.sizes == (2, 2, 4, 8) and placed.balance < even.balance
    assert placed.slowest == pytest.approx(2.0) and even.slowest == pytest.approx(4.0)


STACK = mlp(in_dim=5, width=6, depth=8, num_classes=3)
SIZES = (2, 2, 3, 1)  # four stages of unequal size, eight blocks


@pytest.fixture(scope="module")
def problem():
    params = STACK.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    micro = {"x": jnp.asarray(rng.standard_normal((4, 3, 5)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (4, 3)), jnp.int32)}
    return params, micro


def test_unequal_pipeline_backprop_is_the_sequential_gradient(problem):
    params, micro = problem
    padded, pad, unpad = unequal_stages(STACK, SIZES)
    assert padded.num_layers == 4 * max(SIZES)
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), micro)
    assert float(padded(pad(params), flat)) == pytest.approx(float(STACK(params, flat)), rel=1e-6)
    _, g = pipeline(padded, gpipe_backprop(4, 4), jg.backprop())(pad(params), micro,
                                                                   jax.random.key(0))[:2]
    want = jax.grad(lambda p: jnp.mean(jax.vmap(lambda b: STACK(p, b))(micro)))(params)
    got = unpad(g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
    assert jax.tree.structure(got) == jax.tree.structure(params)
    # the check can fail: another split of the same padded width is another model
    other, pad2, unpad2 = unequal_stages(STACK, (3, 2, 2, 1))
    assert float(other(pad2(params), flat)) == pytest.approx(float(STACK(params, flat)), rel=1e-6)
    with pytest.raises(AssertionError):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
                     unpad2(g), want)


def test_a_forward_estimate_on_unequal_stages_is_the_padded_models(problem):
    """Forward estimates draw tangents per padded block: the pipeline equals the in-memory
    estimator of the padded model per micro-batch (the engine matrix's pipeline variant)."""
    params, micro = problem
    padded, pad, unpad = unequal_stages(STACK, SIZES)
    est = jg.forward(2, "gaussian")
    key = jax.random.key(3)
    _, g = pipeline(padded, gpipe_forward(4, 4), est)(pad(params), micro, key)[:2]
    keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(jnp.arange(4))
    ref = jax.vmap(lambda b, k: est(padded, pad(params), b, k)[1])(micro, keys)
    ref = jax.tree.map(lambda a: a.mean(0), ref)
    # float32 sums in another order: 1e-6 absolute on entries of order 1 (an entry of 1.6e-3
    # differed by 1.6e-7 on one machine)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 unpad(g), unpad(ref))


def test_bad_sizes_are_refused_by_name():
    for sizes in [(2, 2, 2), (0, 4, 4), (9,)]:
        with pytest.raises(ValueError, match="sizes: one positive number of blocks per stage"):
            unequal_stages(STACK, sizes)


def test_composed_engine_runs_unequal_stages(problem, tmp_path):
    """The composed engine (chunk c's slot c·M + s on stage s) over stages of (1, 1, 2, 4)
    layers: backprop equals ``jax.grad`` of the sequential model, and the chunk order puts the
    layers in model order (the contiguous layout in its store would not)."""
    import optax

    from jaxstream.compose import ComposedExecutor, make_mesh
    from jaxstream.stream import LayerStore
    from jaxstream.stream.executor import StreamConfig

    params, micro = problem
    sizes = (1, 1, 2, 4)
    padded, pad, unpad = unequal_stages(STACK, sizes, layout="chunked")
    host = jax.tree.map(np.asarray, pad(params))
    store = LayerStore.create(tmp_path / "s", host, optimizer=optax.sgd(0.1))
    ex = ComposedExecutor(padded, jg.backprop(), optax.sgd(0.1), store,
                          StreamConfig(compute_dtype="float32", prefetch=1),
                          mesh=make_mesh(1, 4))
    _, g = ex.estimate(micro, jax.random.key(0))
    want = jax.grad(lambda p: jnp.mean(jax.vmap(lambda b: STACK(p, b))(micro)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 unpad(g), want)
    _, _, unpad_c = unequal_stages(STACK, sizes)  # the pipeline's layout reads other slots
    with pytest.raises(AssertionError):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
                     unpad_c(g), want)
    with pytest.raises(ValueError, match="layout: 'spread'"):
        unequal_stages(STACK, sizes, layout="spread")
