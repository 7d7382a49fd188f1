"""Measures of a schedule table: makespan, cost-weighted makespan, idle and fill, groups, stash.

The executor runs ticks in lock-step (one ppermute per tick), so a tick lasts as long as its most
expensive op: the cost-weighted makespan is sum_t max_s cost(op[t, s]).

Example:
  >>> from jaxstream.pipeline import gpipe_forward, idle_fraction
  >>> idle_fraction(gpipe_forward(4, 12))  # (M-1)/(N+M-1)
  0.2
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from jaxstream.pipeline.table import BACKWARD_OPS, BW, FBW, GRAD_OPS, IDLE, B, F, Schedule, W
from jaxstream.pipeline.validate import peak_stash


class OpCosts(NamedTuple):
    """Relative (or measured, seconds) cost of the F, B and W ops of one stage."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0

    def table(self) -> np.ndarray:
        """Cost per op code (IDLE, F, B, W, BW, FBW)."""
        return np.array([0.0, self.f, self.b, self.w, self.b + self.w, self.f + self.b + self.w])


UNIT_COSTS = OpCosts()  # every op costs one tick


def makespan(s: Schedule) -> int:
    """Ticks up to and including the last busy one."""
    busy = np.nonzero(s.kind.any(axis=1))[0]
    return int(busy[-1]) + 1 if busy.size else 0


def weighted_makespan(s: Schedule, costs: OpCosts = UNIT_COSTS) -> float:
    """sum over ticks of the costliest op in the tick (lock-step execution)."""
    c = costs.table()[s.kind[: makespan(s)]]
    return float(c.max(axis=1).sum()) if c.size else 0.0


def idle_fraction(s: Schedule) -> float:
    """Share of the (ticks x stages) cells, up to the makespan, with no op."""
    T = makespan(s)
    return float((s.kind[:T] == IDLE).sum() / (T * s.num_stages)) if T else 0.0


def gpipe_idle_fraction(num_stages: int, micro_batches: int) -> float:
    """(M-1)/(N+M-1): the idle fraction of forward-only GPipe."""
    return (num_stages - 1) / (micro_batches + num_stages - 1)


def forward_only_idle_mask(num_stages: int, micro_batches: int) -> np.ndarray:
    """(N+M-1, M) True at the idle cells of the forward-only GPipe table (F_j at tick j+s)."""
    T = micro_batches + num_stages - 1
    t = np.arange(T)[:, None]
    s = np.arange(num_stages)[None, :]
    return (t < s) | (t >= s + micro_batches)


def fill_ratio(s: Schedule) -> float:
    """Share of the forward-only schedule's idle stage-ticks that carry B/W work in this table.

    The forward-only table is aligned with this table's first F (at stage 0), so a table that
    starts with idle ticks (crossstep's leading ticks) is measured against its own forward ops.
    """
    mask = forward_only_idle_mask(s.num_stages, s.micro_batches)
    first = np.nonzero(np.isin(s.kind[:, 0], (F, FBW)))[0]
    lead = int(first[0]) if first.size else 0
    T = min(mask.shape[0], s.num_ticks - lead)
    filled = np.isin(s.kind[lead : lead + T], BACKWARD_OPS) & mask[:T]
    return float(filled.sum() / mask.sum()) if mask.sum() else 0.0


def groups(s: Schedule, stale: bool = False) -> tuple[tuple[int, ...], ...]:
    """Per stage, the sorted micro-batches whose exact weight gradient the table produces (G_s).

    Args:
      stale: False for this step's micro-batches, True for the previous step's (delayed policy).
    """
    out: list[set[int]] = [set() for _ in range(s.num_stages)]
    for _, st, k, j, st_flag in s.cells():
        if k in GRAD_OPS and st_flag == stale:
            out[st].add(j)
    return tuple(tuple(sorted(g)) for g in out)


def coverage(s: Schedule) -> float:
    """Share of the (stage, micro-batch) pairs with an exact gradient (current or previous step)."""
    n = sum(len(g) for g in groups(s)) + sum(len(g) for g in groups(s, stale=True))
    return n / (s.num_stages * s.micro_batches)


def coverage_per_stage(s: Schedule) -> tuple[float, ...]:
    """Per stage, the share of the N micro-batches whose exact gradient reaches it (either step).

    Example:
      >>> from jaxstream.pipeline import truncated
      >>> coverage_per_stage(truncated(4, 8, (0,)))
      (0.0, 0.0, 0.125, 0.125)
    """
    cur, old = groups(s), groups(s, stale=True)
    return tuple(len(a) / s.micro_batches if a else len(b) / s.micro_batches
                 for a, b in zip(cur, old))


def staleness_per_stage(s: Schedule) -> tuple[int | None, ...]:
    """Per stage, how many steps old its exact gradients are: 0 (this step's micro-batches),
    1 (the previous step's), None where the stage gets none.

    Example:
      >>> from jaxstream.pipeline import delayed
      >>> staleness_per_stage(delayed(4, 8, (0,)))
      (1, 1, 1, 1)
    """
    cur, old = groups(s), groups(s, stale=True)
    return tuple(0 if a else 1 if b else None for a, b in zip(cur, old))


def groups_nested(gs) -> bool:
    """True when G_0 is a subset of G_1, ..., of G_{M-1}."""
    return all(set(a) <= set(b) for a, b in itertools.pairwise(gs))


def summary(s: Schedule, costs: OpCosts = UNIT_COSTS) -> dict:
    """All the measures of one table as a flat dict (for tables and JSON rows)."""
    M, N = s.num_stages, s.micro_batches
    n_ops = {name: int(np.isin(s.kind, codes).sum())
             for name, codes in (("F", (F, FBW)), ("B", (B, BW, FBW)), ("W", (W, BW, FBW)))}
    return {
        "policy": s.name,
        "stale": s.is_stale,
        "M": M,
        "N": N,
        "makespan_ticks": makespan(s),
        "added_ticks": makespan(s) - (N + M - 1),
        "weighted_makespan": weighted_makespan(s, costs),
        "idle_fraction": idle_fraction(s),
        "fill_ratio": fill_ratio(s),
        "coverage": coverage(s),
        "coverage_per_stage": list(coverage_per_stage(s)),
        "staleness_per_stage": list(staleness_per_stage(s)),
        "peak_stash": int(peak_stash(s).max(initial=0)),
        "ops": n_ops,
    }
