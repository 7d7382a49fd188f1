"""The composed engine's steady step blocks on the main thread only for the step's few scalars,
the same number at depth 4 and 8 (counted from outside the code, :mod:`tests.stream.blocking`):
gradients are handed on as each stage's device values, the stash is read on the reverse sweep's
loading thread, the windows' tick counts are summed on the device and read once; and it runs
no eager op per layer or window (host-side per-layer work jitted) and traces nothing."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, StreamConfig
from tests.stream.blocking import count_steady_step

SGD = optax.sgd(0.1)
# (estimator, most blocking reads per step): the losses, the metrics' tick counts (two arrays),
# the key data (one read per step, shared by the units); a hybrid's selection and its sums
CASES = {
    "backprop": (jg.backprop(), 4),
    "forward": (jg.forward(num_tangents=2), 6),
    "hybrid": (jg.hybrid(num_exact=2, num_tangents=2), 8),
}


def _steady(tmp_path, depth: int, case: str) -> tuple:
    est, _ = CASES[case]
    stack = mlp(6, 8, depth, 3)
    store = LayerStore.create(tmp_path / f"s{depth}", stack.init(jax.random.key(0)),
                              optimizer=SGD)
    ex = ComposedExecutor(stack, est, SGD, store, StreamConfig(compute_dtype="float32"),
                          mesh=make_mesh(2, 2))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((4, 4, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (4, 4))}
    return count_steady_step(ex, batch)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_composed_step_blocks_a_few_times_whatever_the_depth(tmp_path, case):
    (b4, d4), (b8, d8) = (_steady(tmp_path, depth, case) for depth in (4, 8))
    assert b4.total == b8.total, (dict(b4.sites), dict(b8.sites))
    assert b8.total <= CASES[case][1], dict(b8.sites)
    assert d4.traces == d8.traces == 0
    assert d4.eager == d8.eager  # no eager op per layer or window
