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
    "evaluate_split",
    "measure_layer_costs",
    "place_by_type",
    "place_stages",
    "type_times",
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
    split = evaluate_split(costs[None, :] / speeds[:, None], sizes)
    return split._replace(ideal=float(costs.sum() / speeds.sum()))


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
    return evaluate_placement(costs, speeds, _split(costs[None, :] / speeds[:, None]))


def _split(times: np.ndarray) -> list[int]:
    """Layers per stage of the contiguous split minimising the slowest stage, exactly (dynamic
    programming over split points, O(M L²)); ``times[s, l]``: layer l's time on stage s."""
    num_stages, num_layers = times.shape
    prefix = np.concatenate([np.zeros((num_stages, 1)), np.cumsum(times, axis=1)], axis=1)
    # best[s, j]: slowest time when the first j layers go to stages 0..s-1.
    best = np.full((num_stages + 1, num_layers + 1), np.inf)
    cut = np.zeros((num_stages + 1, num_layers + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, num_layers - (num_stages - s) + 1):
            i = np.arange(s - 1, j)  # stage s-1 takes layers i..j-1
            cand = np.maximum(best[s - 1, i], prefix[s - 1, j] - prefix[s - 1, i])
            k = int(np.argmin(cand))
            best[s, j], cut[s, j] = cand[k], i[k]
    sizes, j = [], num_layers
    for s in range(num_stages, 0, -1):
        i = int(cut[s, j])
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def type_times(layer_types: Sequence[str], layer_work: Sequence[float],
               device_kinds: Sequence[str], throughput: dict) -> np.ndarray:
    """``times[s, l]``: layer l's work over the throughput of stage s's device kind for its
    layer type (``throughput[(kind, type)]``, work per second). Raises ValueError naming a
    missing or non-positive (kind, type) pair."""
    work = np.asarray(layer_work, np.float64)
    if len(layer_types) != work.size or not np.all(np.isfinite(work)) or np.any(work < 0):
        raise ValueError(f"layer_work: {work.size} finite values >= 0, one per layer type "
                         f"({len(layer_types)} given)")
    times = np.empty((len(device_kinds), work.size))
    for s, kind in enumerate(device_kinds):
        for l, t in enumerate(layer_types):
            rate = throughput.get((kind, t))
            if rate is None or not np.isfinite(rate) or rate <= 0:
                raise ValueError(f"throughput[({kind!r}, {t!r})]: a positive rate is needed for "
                                 f"every (device kind, layer type) pair, got {rate!r}")
            times[s, l] = work[l] / rate
    return times


def place_by_type(layer_types: Sequence[str], layer_work: Sequence[float],
                  device_kinds: Sequence[str], throughput: dict) -> Placement:
    """Contiguous split of layers over stages of several device kinds, each kind running each
    layer type at its own rate (seed 001's placement by layer type: a dense layer on the kind
    that multiplies fastest, an activation layer where memory bandwidth is), minimising the
    slowest stage exactly.

    Args:
      layer_types: each layer's type, e.g. ``"dense"``, ``"conv"``, ``"activation"``.
      layer_work: each layer's work (FLOPs, bytes: the unit the throughputs are in).
      device_kinds: stage s's device kind, e.g. ``("gpu", "gpu", "cpu")``.
      throughput: ``{(kind, type): work per second}`` for every pair used.

    Returns:
      The optimal :class:`Placement` (its ``ideal`` is the mean stage time: with rates per
      layer type there is no one total speed to divide by).

    Example:
      >>> place_by_type(["dense", "act", "dense"], [4, 1, 4], ["gpu", "cpu"],
      ...               {("gpu", "dense"): 8, ("gpu", "act"): 1, ("cpu", "dense"): 1,
      ...                ("cpu", "act"): 2}).sizes
      (2, 1)
    """
    times = type_times(layer_types, layer_work, device_kinds, throughput)
    if times.shape[0] > times.shape[1]:
        raise ValueError(f"more stages than layers: {times.shape[0]} device kinds for "
                         f"{times.shape[1]} layers; every stage needs at least one layer")
    return evaluate_split(times, _split(times))


def evaluate_split(times: np.ndarray, sizes: Sequence[int]) -> Placement:
    """Stage times and balance of ``sizes`` given per-stage layer times ``times[s, l]``."""
    sizes = tuple(int(x) for x in sizes)
    if len(sizes) != times.shape[0] or sum(sizes) != times.shape[1] or min(sizes) < 1:
        raise ValueError(f"sizes must be {times.shape[0]} positive integers summing to "
                         f"{times.shape[1]}; got {sizes}")
    starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    stage = tuple(float(times[s, a:a + n].sum()) for s, (a, n) in enumerate(zip(starts, sizes)))
    mean = float(np.mean(stage))
    return Placement(sizes, starts, stage, max(stage), max(stage) / mean if mean > 0 else 1.0,
                     mean)


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
    return np.asarray([min_time(jax.jit(fn), a, repeats)
                       for fn, a in zip(layers, args, strict=True)])


def min_time(jitted: Any, args: Any, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``jitted(*args)`` after one untimed (compile)."""
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - t0)
    return float(min(times))
