"""The streamed warm-up compiles a step without holding a whole-model gradient on the host: its
host memory does not grow with the model's depth (a model near the host's memory must warm up
as it trains). Host memory is NumPy's, traced by ``tracemalloc`` (the host copies of a unit's
gradient and parameters are NumPy arrays)."""

from __future__ import annotations

import tracemalloc

import jax
import numpy as np
import optax

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

WIDTH = 256


def _warm_up_peak(est, depth: int, root) -> tuple[int, int]:
    """(peak traced host bytes during ``warm_up``, the model's bytes) at ``depth``."""
    stack = mlp(in_dim=16, width=WIDTH, depth=depth, num_classes=4)
    params = jax.device_get(stack.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((2, 8, 16), dtype=np.float32),
             "y": rng.integers(0, 4, (2, 8), dtype=np.int32)}
    store = LayerStore.create(root / f"d{depth}", params, optimizer=optax.sgd(0.1))
    ex = StreamedExecutor(stack, est, optax.sgd(0.1), store, StreamConfig(compute_dtype="float32"))
    try:
        tracemalloc.start()
        ex.warm_up(batch, jax.random.key(1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        ex.close()
    assert store.step == 0  # nothing committed
    return peak, sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))


def test_the_warm_up_holds_no_whole_model_gradient(tmp_path):
    """A hybrid: both sweeps (forward and reverse) and its combine run in the warm-up."""
    est = jg.hybrid(exact_indices=(0,), num_tangents=1)
    small, small_bytes = _warm_up_peak(est, 4, tmp_path)
    large, large_bytes = _warm_up_peak(est, 24, tmp_path)
    grown = large - small
    # 20 more blocks of 256 KiB: a warm-up holding the model's gradient grows by ≥ that much
    # (1.4–1.9× of it, measured, when it did); one holding a unit at a time by a fraction.
    assert grown < 0.25 * (large_bytes - small_bytes), (grown, large_bytes - small_bytes)
