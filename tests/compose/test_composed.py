"""The composed engine (streamed pipeline stages over a data × stage mesh) equals the in-memory
estimators for the same keys, writes its updates like the one-device streamed executor, and
refuses bad meshes and batches before computing."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, chunk_cost, make_mesh
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, StreamConfig, StreamedExecutor
from tests.trees import max_rel_err

N, B = 4, 2
STACK = mlp(5, 6, 4, 3)
FP32 = StreamConfig(compute_dtype="float32", prefetch=1)
SGD, ADAM = optax.sgd(0.1), optax.adam(1e-2)

HYBRID = jg.hybrid(num_exact=2, num_tangents=2)


@pytest.fixture(scope="module")
def data():
    params = STACK.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, B, 5), dtype=np.float32)
    y = rng.integers(0, 3, (N, B), dtype=np.int32)
    return params, {"x": x, "y": y}, {"x": x.reshape(N * B, 5), "y": y.reshape(N * B)}


# The composed engine's gradient for every estimator, against the in-memory estimator for the
# same keys, is a column of tests/test_engine_matrix.py.


def test_composed_steps_equal_streamed_steps(tmp_path, data):
    """Two Adam steps on a 2 × 2 mesh leave the store as the one-device executor does."""
    params, micro, _ = data
    est = HYBRID
    a = LayerStore.create(tmp_path / "a", params, optimizer=ADAM)
    b = LayerStore.create(tmp_path / "b", params, optimizer=ADAM)
    comp = ComposedExecutor(STACK, est, ADAM, a, FP32, mesh=make_mesh(2, 2))
    one = StreamedExecutor(STACK, est, ADAM, b, FP32)
    for i in range(2):
        m = comp.step(micro, jax.random.key(i))
        one.step(micro, jax.random.key(i))
    # forward, reverse (its first chunk still resident from the forward: 2 layers), update
    assert a.step == b.step == 2 and m["layers_read"] == 3 * STACK.num_layers - 2
    assert max_rel_err(a.read_params(), b.read_params()) <= 1e-5
    assert max_rel_err(a.read_params(), params) > 1e-4  # the steps changed the parameters


@pytest.mark.parametrize("correction", ["control_variate", "guess"])
def test_deferred_update_equals_eager_on_the_mesh(tmp_path, data, correction):
    """update="lazy" on a 2 × 2 mesh: the hybrid's update applied at each layer's next read
    leaves the store as the eager update sweep does, bit for bit, reading L − M = 2 layers
    fewer than 2 L per step (control variate; the guess sweeps along its direction once more)."""
    params, micro, _ = data
    est = jg.hybrid(num_exact=2, num_tangents=2, correction=correction)
    out = {}
    for mode in ("eager", "lazy"):
        store = LayerStore.create(tmp_path / mode, params, optimizer=ADAM)
        cfg = StreamConfig(compute_dtype="float32", update=mode)
        ex = ComposedExecutor(STACK, est, ADAM, store, cfg, mesh=make_mesh(2, 2))
        reads = [ex.step(micro, jax.random.key(i))["layers_read"] for i in range(3)]
        ex.flush()
        out[mode] = LayerStore.open(tmp_path / mode).read_params(), reads
    extra = 1 if correction == "guess" else 0  # the sweep along the exact direction
    assert out["eager"][1] == [(3 + extra) * STACK.num_layers - 2] * 3
    assert out["lazy"][1] == [(2 + extra) * STACK.num_layers - 2] * 3
    assert out["lazy"][1][0] == chunk_cost(
        "hybrid_guess" if extra else "hybrid_cv", layers=4, stages=2, micro_batches=N,
        selected=2, update="lazy").layer_reads
    for a, b in zip(jax.tree.leaves(out["lazy"][0]), jax.tree.leaves(out["eager"][0])):
        np.testing.assert_array_equal(a, b)


def test_bad_mesh_depth_and_batch(tmp_path, data):
    params, micro, _ = data
    with pytest.raises(ValueError, match="data × stage = 3 × 2"):
        make_mesh(3, 2)
    with pytest.raises(ValueError, match="stage must be an int >= 1"):
        make_mesh(1, 0)
    store = LayerStore.create(tmp_path / "s", params, optimizer=SGD)
    with pytest.raises(ValueError, match="stage = 8 must divide the model's 4 layers"):
        ComposedExecutor(STACK, jg.backprop(), SGD, store, FP32, mesh=make_mesh(1, 8))
    ex = ComposedExecutor(STACK, jg.backprop(), SGD, store, FP32, mesh=make_mesh(4, 1))
    odd = {k: v[:, :1] for k, v in micro.items()}  # B = 1 examples over 4 replicas
    with pytest.raises(ValueError, match="micro-batch size 1 must be divisible by data = 4"):
        ex.step(odd, jax.random.key(0))
    assert store.step == 0 and max_rel_err(store.read_params(), params) == 0.0


def test_cost_model_counts():
    """Ticks and reads of both schedules, against a count by hand for C = 2 chunks of M = 4,
    N = 8, S = 2: chunked, a pass of N + M - 1 per chunk and sweep; circular, the forward sweep
    2 · 8 + 3 ticks (period N, one drain), the reverse 2 · 4 + 1 (period M, chains S)."""
    kw = {"layers": 8, "stages": 4, "micro_batches": 8, "selected": 2}
    c = chunk_cost("hybrid_cv", schedule="chunked", **kw)
    assert c.ticks == 2 * (8 + 3) + 2 * (2 + 3) and c.layer_reads == 3 * 8 - 4
    assert c.bubble_fraction == pytest.approx(1 - (2 * 8 + 2 * 2) / c.ticks)
    c = chunk_cost("hybrid_cv", **kw)
    assert c.ticks == (2 * 8 + 3) + (2 * 4 + 1) and c.layer_reads == 3 * 8 - 4
    # deferred to the next read: forward and reverse only; ticks unchanged
    lazy = chunk_cost("hybrid_cv", update="lazy", **kw)
    assert (lazy.ticks, lazy.layer_reads) == (c.ticks, 2 * 8 - 4)
    assert chunk_cost("hybrid_guess", update="lazy", **kw).layer_reads == 3 * 8 - 4
    assert chunk_cost("forward", update="lazy", **kw).layer_reads == 8
    assert c.bubble_fraction == pytest.approx(1 - (2 * 8 + 2 * 2) / c.ticks)
    assert c.resident_layers_per_device == 2 + 2  # p = 2 prefetched, running, draining
    with pytest.raises(ValueError, match="kind must be one of"):
        chunk_cost("nosuch", layers=8, stages=4, micro_batches=8)
    with pytest.raises(ValueError, match="schedule must be one of"):
        chunk_cost("forward", schedule="looped", **kw)
    with pytest.raises(ValueError, match="update must be one of"):
        chunk_cost("forward", update="later", **kw)
