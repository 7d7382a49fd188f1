"""Heterogeneous stage placement: contiguous blocks of layers to pipeline stages.

Stage s runs on device s of the ``stage`` axis, whose speed is ``device_speeds[s]`` (work
per second, any unit); layer l costs ``layer_costs[l]`` (the same unit of work, e.g. seconds
measured on a reference device).  Stage time = sum of its layers' costs / its speed; a
pipeline tick lasts as long as the slowest stage, so the placement minimises the slowest
stage time, exactly, by dynamic programming over split points (O(M L^2)).
Balance = slowest / mean stage time (1.0 is perfect).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
    "Placement",
    "evaluate_placement",
    "measure_layer_costs",
    "place_stages",
    "uniform_placement",
]  # fmt: skip


class Placement(NamedTuple):
    """Layers per stage and the resulting stage times.

    ``sizes[s]`` layers go to stage s, in order; ``starts[s]`` is its first layer;
    ``balance`` = slowest / mean stage time; ``ideal`` = total cost / total speed.
    """

    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    stage_times: tuple[float, ...]
    slowest: float
    balance: float
    ideal: float


def _check(layer_costs: Sequence[float], device_speeds: Sequence[float]):
    costs = np.asarray(layer_costs, dtype=np.float64)
    speeds = np.asarray(device_speeds, dtype=np.float64)
    if costs.ndim != 1 or costs.size == 0:
        raise ValueError(f"layer_costs must be a non-empty 1-D sequence; got shape {costs.shape}")
    if speeds.ndim != 1 or speeds.size == 0:
        raise ValueError(
            f"device_speeds must be a non-empty 1-D sequence (one per stage); got shape {speeds.shape}"
        )
    if not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError("layer_costs must be finite and >= 0")
    if not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
        raise ValueError("device_speeds must be finite and > 0")
    if speeds.size > costs.size:
        raise ValueError(
            f"more stages than layers: len(device_speeds)={speeds.size} stages but "
            f"len(layer_costs)={costs.size} layers; every stage needs at least one layer"
        )
    return costs, speeds


def evaluate_placement(
    layer_costs: Sequence[float], device_speeds: Sequence[float], sizes: Sequence[int]
) -> Placement:
    """Stage times and balance of a given split ``sizes`` (layers per stage, in order)."""
    costs, speeds = _check(layer_costs, device_speeds)
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != speeds.size or sum(sizes) != costs.size or min(sizes) < 1:
        raise ValueError(
            f"sizes must be {speeds.size} positive integers summing to {costs.size}; got {sizes}"
        )
    starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    times = tuple(
        float(costs[a : a + n].sum() / v) for a, n, v in zip(starts, sizes, speeds, strict=True)
    )
    slowest = max(times)
    mean = float(np.mean(times))
    ideal = float(costs.sum() / speeds.sum())
    return Placement(sizes, starts, times, slowest, slowest / mean if mean > 0 else 1.0, ideal)


def uniform_placement(layer_costs: Sequence[float], device_speeds: Sequence[float]) -> Placement:
    """The speed- and cost-blind split: layers divided as evenly as possible by count."""
    costs, speeds = _check(layer_costs, device_speeds)
    base, extra = divmod(costs.size, speeds.size)
    sizes = [base + (1 if s < extra else 0) for s in range(speeds.size)]
    return evaluate_placement(costs, speeds, sizes)


def place_stages(layer_costs: Sequence[float], device_speeds: Sequence[float]) -> Placement:
    """Contiguous split of layers over stages minimising the slowest stage time (exact).

    Args:
      layer_costs: per-layer cost, length L (e.g. measured seconds on a reference device).
      device_speeds: per-stage device speed, length M <= L (relative; 2.0 = twice as fast).

    Returns:
      The optimal :class:`Placement`.

    Raises:
      ValueError: M > L, or non-positive / non-finite input; raised before any search.

    Example:
      >>> p = place_stages([1, 1, 4, 4, 1, 1], [1.0, 2.0])
      >>> p.sizes, p.balance
    """
    costs, speeds = _check(layer_costs, device_speeds)
    num_layers, num_stages = costs.size, speeds.size
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    inf = np.inf
    # best[s, j]: slowest time when the first j layers go to stages 0..s-1.
    best = np.full((num_stages + 1, num_layers + 1), inf)
    cut = np.zeros((num_stages + 1, num_layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, num_layers - (num_stages - s) + 1):
            i = np.arange(s - 1, j)  # stage s-1 takes layers i..j-1
            cand = np.maximum(best[s - 1, i], (prefix[j] - prefix[i]) / speeds[s - 1])
            k = int(np.argmin(cand))
            best[s, j], cut[s, j] = cand[k], i[k]
    sizes, j = [], num_layers
    for s in range(num_stages, 0, -1):
        i = int(cut[s, j])
        sizes.append(j - i)
        j = i
    return evaluate_placement(costs, speeds, sizes[::-1])


def measure_layer_costs(
    layers: Sequence[Callable[..., Any]], args: Sequence[tuple], *, repeats: int = 5
) -> np.ndarray:
    """Fastest wall time (s) of each jitted layer: the least disturbed by other load.

    Args:
      layers: one callable per layer.
      args: one argument tuple per layer.
      repeats: timed calls per layer after one warm-up (compile) call.

    Returns:
      (L,) float64 array of seconds.
    """
    out = []
    for fn, a in zip(layers, args, strict=True):
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(*a))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(jitted(*a))
            times.append(time.perf_counter() - t0)
        out.append(float(np.min(times)))
    return np.asarray(out)
