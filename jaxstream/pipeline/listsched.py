"""Greedy list scheduling of F and B/W ops on a pipeline, tick by tick.

Each tick, each stage runs the first ready op in its priority order. F runs in micro-batch order;
a selected micro-batch's B at stage s is ready once its cotangent arrived (loss on the last stage,
B at stage s+1 otherwise); W is ready with the same cotangent. With `split=False` B and W are
fused (BW); with `split=True` stage 0 runs only W (no stage below needs its input cotangent).

Example:
  >>> list_schedule(2, 2, [0, 1], priority=("F", "B", "W"), split=False).num_ticks
  6
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from jaxstream.pipeline.metrics import UNIT_COSTS, OpCosts, makespan, weighted_makespan
from jaxstream.pipeline.table import Schedule


def list_schedule(num_stages: int, micro_batches: int, selected: Sequence[int], *,
                  priority: Sequence[str] = ("B", "F", "W"), split: bool = False,
                  in_flight: Sequence[int] | None = None) -> Schedule:
    """One greedy schedule (see the module docstring).

    Args:
      selected: micro-batches that get full backward chains.
      priority: order in which a stage prefers ready "B", "F", "W" ops.
      split: Zero-Bubble B/W split (True) or fused BW (False).
      in_flight: per stage, the most micro-batches between F and their B (1F1B), None for no cap.
    """
    M, N = num_stages, micro_batches
    sel = list(selected)
    INF = 1 << 30
    f_done = np.full((M, N), INF)
    b_done = np.full((M, N), INF)  # input cotangent sent (B or BW)
    next_f = [0] * M
    b_queue = [list(sel) for _ in range(M)]
    w_queue = [list(sel) for _ in range(M)] if split else [[] for _ in range(M)]
    rows: list[list] = []
    t = 0
    limit = 4 * (N + M) * 4 + 16
    while any(next_f[s] < N or b_queue[s] or w_queue[s] for s in range(M)):
        if t > limit:
            raise RuntimeError("list scheduling did not converge")
        row = [None] * M
        for s in range(M):
            def cot_ready(j, s=s, t=t):
                return f_done[s, j] < t and (f_done[s, j] < t if s == M - 1 else b_done[s + 1, j] < t)

            for p in priority:
                if p == "F" and next_f[s] < N:
                    j = next_f[s]
                    busy = sum(1 for i in sel if f_done[s, i] < INF and b_done[s, i] == INF)
                    cap_ok = in_flight is None or busy < in_flight[s]
                    if (s == 0 or f_done[s - 1, j] < t) and cap_ok:
                        row[s] = ("F", j)
                        f_done[s, j] = t
                        next_f[s] += 1
                        break
                elif p == "B" and b_queue[s]:
                    ready = [j for j in b_queue[s] if cot_ready(j)]
                    if split and s == 0:
                        ready = []
                        b_queue[s] = []
                    if ready:
                        j = ready[0]
                        b_queue[s].remove(j)
                        row[s] = ("B" if split else "BW", j)
                        b_done[s, j] = t
                        break
                elif p == "W" and w_queue[s]:
                    ready = [j for j in w_queue[s] if cot_ready(j)]
                    if ready:
                        j = ready[0]
                        w_queue[s].remove(j)
                        row[s] = ("W", j)
                        break
        rows.append(row)
        t += 1
    return Schedule.from_ops(M, N, rows, name="list")


def best_list_schedule(num_stages: int, micro_batches: int, selected: Sequence[int],
                       costs: OpCosts = UNIT_COSTS) -> Schedule:
    """The fewest-ticks (then cheapest cost-weighted) table over priority rules and B/W split."""
    best, key = None, None
    for prio in itertools.permutations(("B", "F", "W")):
        for split in (False, True):
            if not split and prio.index("W") != 2:
                continue  # W is never scheduled on its own when fused
            s = list_schedule(num_stages, micro_batches, selected, priority=prio, split=split)
            k = (makespan(s), weighted_makespan(s, costs))
            if key is None or k < key:
                best, key = s, k
                best.meta.update(priority=prio, split=split)
    return best
