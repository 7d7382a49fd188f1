"""Schedule generators: forward-only GPipe and the policies that fill its bubbles.

  gpipe_forward   F only: F_j at stage s on tick j+s; idle fraction (M-1)/(N+M-1).
  truncated       forward-only ticks; each selected chain starts from the loss (FBW on the last
                  stage) and goes down through idle slots until none is left: nested groups.
  delayed         forward-only ticks; the *previous* step's selected micro-batches run their
                  chains in this step's idle slots (warm-up, then cool-down): stale by one step.
  crossstep       forward-only ticks (plus `added_ticks`); *full* chains of the previous step's
                  selected micro-batches across the step boundary: every stage, stale by one
                  step (cross_step.py; one chain fits with zero added ticks at even M).
  complete        full chains for the selected micro-batches with the fewest added ticks
                  (list-scheduled, see listsched.py).
  gpipe_backprop, one_f_one_b   backprop baselines (every micro-batch gets its chain).

Example:
  >>> from jaxstream.pipeline import truncated, groups
  >>> groups(truncated(4, 8, selected=(0,)))
  ((), (), (0,), (0,))
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxstream.pipeline.cross_step import crossstep
from jaxstream.pipeline.listsched import best_list_schedule, list_schedule
from jaxstream.pipeline.metrics import UNIT_COSTS, OpCosts
from jaxstream.pipeline.table import BW, FBW, IDLE, F, Schedule


def check_selected(num_stages: int, micro_batches: int, selected: Sequence[int]) -> tuple:
    """Validates (M, N, selected) and returns the selection as a sorted tuple of ints."""
    if int(num_stages) < 1:
        raise ValueError(f"num_stages={num_stages}; must be >= 1")
    if int(micro_batches) < 1:
        raise ValueError(f"micro_batches={micro_batches}; must be >= 1")
    sel = tuple(sorted({int(j) for j in selected}))
    bad = [j for j in sel if not 0 <= j < micro_batches]
    if bad:
        raise ValueError(f"selected micro-batch {bad[0]} outside 0..{micro_batches - 1} "
                         f"(micro_batches={micro_batches})")
    return sel


def gpipe_forward(num_stages: int, micro_batches: int) -> Schedule:
    """Forward-only GPipe: T = N+M-1 ticks, F_j at stage s on tick j+s."""
    M, N = int(num_stages), int(micro_batches)
    check_selected(M, N, ())
    s = Schedule.empty(N + M - 1, M, N, name="forward")
    for st in range(M):
        s.kind[st : st + N, st] = F
        s.micro[st : st + N, st] = np.arange(N)
    return s


def _chain_down(s: Schedule, j: int, top: int, t_prev: int, stale: bool) -> None:
    """Places BW_j at stages top, top-1, ... in the earliest idle tick after the previous one."""
    for st in range(top, -1, -1):
        free = np.nonzero(s.kind[t_prev + 1 :, st] == IDLE)[0]
        if free.size == 0:
            return
        t = t_prev + 1 + int(free[0])
        s.kind[t, st], s.micro[t, st], s.stale[t, st] = BW, j, stale
        t_prev = t


def truncated(num_stages: int, micro_batches: int, selected: Sequence[int]) -> Schedule:
    """Forward-only ticks; chains of the selected micro-batches stop where no idle slot is left.

    The last stage has no idle tick after its first F, so a selected micro-batch's chain starts
    inside its last-stage F (FBW: F, loss, and the stage's B and W in one op, costed F+B+W).
    """
    M, N = int(num_stages), int(micro_batches)
    sel = check_selected(M, N, selected)
    s = gpipe_forward(M, N)
    s = Schedule(s.kind, s.micro, s.stale, N, name="truncated")
    for j in sel:
        t = j + M - 1
        s.kind[t, M - 1] = FBW
        _chain_down(s, j, M - 2, t, stale=False)
    return s


def delayed(num_stages: int, micro_batches: int, selected: Sequence[int]) -> Schedule:
    """Forward-only ticks; the previous step's selected chains run in this step's idle slots.

    The exact gradients are those of the previous step's micro-batches at the previous step's
    parameters: stale by one step (the table is named "delayed (stale 1 step)").
    """
    M, N = int(num_stages), int(micro_batches)
    sel = check_selected(M, N, selected)
    s = gpipe_forward(M, N)
    s = Schedule(s.kind, s.micro, s.stale, N, name="delayed (stale 1 step)")
    for j in sel:
        _chain_down(s, j, M - 1, -1, stale=True)
    return s


def complete(num_stages: int, micro_batches: int, selected: Sequence[int],
             costs: OpCosts = UNIT_COSTS) -> Schedule:
    """Full chains (every stage) for the selected micro-batches, with the fewest added ticks
    among its list-scheduling rules (a heuristic, not a proven minimum).

    List-scheduled under several priority rules, fused BW and Zero-Bubble split B/W with W in the
    gaps; the table with the fewest ticks, then the lowest cost-weighted makespan, wins.
    """
    M, N = int(num_stages), int(micro_batches)
    sel = check_selected(M, N, selected)
    s = best_list_schedule(M, N, sel, costs)
    return Schedule(s.kind, s.micro, s.stale, N, name="complete", meta=s.meta)


def gpipe_backprop(num_stages: int, micro_batches: int) -> Schedule:
    """GPipe with backprop: all forwards, then every micro-batch's BW chain (2(N+M-1) ticks)."""
    M, N = int(num_stages), int(micro_batches)
    check_selected(M, N, ())
    s = list_schedule(M, N, range(N), priority=("F", "B", "W"), split=False)
    return Schedule(s.kind, s.micro, s.stale, N, name="gpipe-backprop")


def one_f_one_b(num_stages: int, micro_batches: int) -> Schedule:
    """1F1B with backprop: stage s keeps at most M-s micro-batches in flight."""
    M, N = int(num_stages), int(micro_batches)
    check_selected(M, N, ())
    s = list_schedule(M, N, range(N), priority=("B", "F", "W"), split=False,
                      in_flight=[M - st for st in range(M)])
    return Schedule(s.kind, s.micro, s.stale, N, name="1f1b")


POLICIES = {"truncated": truncated, "delayed": delayed, "complete": complete,
            "crossstep": crossstep}


def make_schedule(policy: str, num_stages: int, micro_batches: int,
                  selected: Sequence[int] = (), costs: OpCosts = UNIT_COSTS) -> Schedule:
    """The table of a named policy: "forward", "truncated", "delayed", "complete", "crossstep".

    "crossstep" gets zero added ticks here (call `crossstep` for a tick budget).

    Example:
      >>> make_schedule("complete", 4, 8, (0, 1)).num_ticks  # N+M-1 = 11, plus 2
      13
    """
    if policy == "forward":
        return gpipe_forward(num_stages, micro_batches)
    if policy == "complete":
        return complete(num_stages, micro_batches, selected, costs)
    if policy in POLICIES:
        return POLICIES[policy](num_stages, micro_batches, selected)
    raise ValueError(f"policy={policy!r}; allowed: 'forward', {', '.join(map(repr, POLICIES))}")
