"""Cross-step reverse chains: every stage gets the previous step's exact gradients.

Between the drain of step t and the warm-up of step t+1 every stage is idle for M-1 ticks. A
reverse chain for a selected micro-batch of step t starts on the last stage in step t+1's
warm-up, descends one stage per tick while the warm-up lasts (stages s >= M/2), and continues in
step t+1's drain at the lower stages. All its ops are *stale*: they belong to the previous step's
micro-batch, at the previous step's parameters (the executor's ``PipelineCarry``), so every
stage's exact gradient is exactly one step old.

How many full chains fit. A chain is at stage s no earlier than tick M-1-s (one hop per tick
from the last stage); stage s's warm-up ends at tick s-1, so the warm-up carries it down to stage
M/2. In the drain (ticks N+s .. N+M-2 at stage s) a chain entering at stage d reaches stage 0 no
earlier than tick N+2d, so it must enter at d <= M/2-1, i.e. it must have left the warm-up at
stage M/2 at tick M/2-1: only the chain that starts on tick 0 does. Hence, with zero added ticks,
exactly one full chain fits for even M and none for odd M (the middle stage is reached neither in
the warm-up nor in the drain). Added ticks (an idle tick before the forward ops lengthens
every warm-up by one, one after lengthens every drain by one) make room for more: a second chain
needs two, each further one about one more (the same as `complete`'s non-stale chains once
N >= 2M). `min_added_ticks` finds the fewest by search; `crossstep` raises when ``added_ticks``
is too few; `max_coverage` gives the most exact gradients (partial chains) for a tick budget.

Example:
  >>> from jaxstream.pipeline import crossstep, groups
  >>> s = crossstep(4, 8, (0,))          # zero added ticks: T = N+M-1 = 11
  >>> s.num_ticks, groups(s, stale=True)
  (11, ((0,), (0,), (0,), (0,)))
  >>> crossstep(4, 8, (0, 1), added_ticks=2).num_ticks
  13
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxstream.pipeline.table import BW, IDLE, F, Schedule
from jaxstream.pipeline.validate import peak_stash

NAME = "crossstep (stale 1 step)"


def _check(num_stages: int, micro_batches: int, selected: Sequence[int],
           added_ticks: int) -> tuple:
    M, N = int(num_stages), int(micro_batches)
    if M < 1:
        raise ValueError(f"num_stages={num_stages}; must be >= 1")
    if N < 1:
        raise ValueError(f"micro_batches={micro_batches}; must be >= 1")
    if int(added_ticks) < 0:
        raise ValueError(f"added_ticks={added_ticks}; must be >= 0")
    sel = tuple(sorted({int(j) for j in selected}))
    bad = [j for j in sel if not 0 <= j < N]
    if bad:
        raise ValueError(f"selected micro-batch {bad[0]} outside 0..{N - 1} "
                         f"(micro_batches={N})")
    return M, N, sel


def _forward(M: int, N: int, lead: int, trail: int) -> Schedule:
    """Forward-only GPipe shifted by `lead` idle ticks, with `trail` idle ticks at the end."""
    s = Schedule.empty(N + M - 1 + lead + trail, M, N, name=NAME)
    for st in range(M):
        s.kind[lead + st : lead + st + N, st] = F
        s.micro[lead + st : lead + st + N, st] = np.arange(N)
    return s


def _place(s: Schedule, sel: tuple) -> list[int]:
    """Stale BW chains from the last stage down, each in the earliest idle cells; lowest stages."""
    low = []
    for j in sel:
        t_prev, reached = -1, s.num_stages
        for st in range(s.num_stages - 1, -1, -1):
            free = np.nonzero(s.kind[t_prev + 1 :, st] == IDLE)[0]
            if free.size == 0:
                break
            t = t_prev + 1 + int(free[0])
            s.kind[t, st], s.micro[t, st], s.stale[t, st] = BW, j, True
            t_prev, reached = t, st
        low.append(reached)
    return low


def _candidates(M: int, N: int, sel: tuple, added_ticks: int):
    """(schedule, lowest stage per chain) for every split of the added ticks (lead, trail)."""
    for lead in range(added_ticks + 1):
        s = _forward(M, N, lead, added_ticks - lead)
        yield s, _place(s, sel)


def _score(s: Schedule, low: list[int]) -> tuple:
    covered = sum(s.num_stages - r for r in low)
    return (covered, -int(peak_stash(s).max(initial=0)))


def crossstep(num_stages: int, micro_batches: int, selected: Sequence[int],
              added_ticks: int = 0) -> Schedule:
    """Full stale chains (every stage) for the previous step's selected micro-batches.

    Args:
      num_stages, micro_batches: M and N.
      selected: the micro-batches whose exact gradients every stage gets one step later.
      added_ticks: ticks allowed over forward-only GPipe (N+M-1); the split between leading and
        trailing idle ticks is searched.

    Raises:
      ValueError naming ``selected`` (or ``num_stages``) when the chains do not all reach stage 0
        within the budget; the message gives the most chains that fit and the ticks needed.
    """
    M, N, sel = _check(num_stages, micro_batches, selected, added_ticks)
    best = None
    for s, low in _candidates(M, N, sel, int(added_ticks)):
        if all(r == 0 for r in low) and (best is None or _score(s, low) > _score(*best)):
            best = (s, low)
    if best is None:
        fit = max_full_chains(M, N, added_ticks)
        need = min_added_ticks(M, N, len(sel))
        why = (f"num_stages={M} is odd: the middle stage is reached neither in the warm-up nor "
               f"in the drain" if fit == 0 and added_ticks == 0 else
               f"at most {fit} full chain(s) fit")
        raise ValueError(
            f"selected={sel}: {len(sel)} full cross-step chains do not fit in "
            f"added_ticks={added_ticks} (M={M}, N={N}): {why}; pass added_ticks>={need} or "
            f"select at most {fit} micro-batch(es) (or use max_coverage for partial chains)")
    s = best[0]
    s.meta.update(added_ticks=int(added_ticks), lead=int(np.nonzero(s.kind[:, 0] == F)[0][0]))
    return s


def max_coverage(num_stages: int, micro_batches: int, selected: Sequence[int],
                 added_ticks: int = 0) -> Schedule:
    """The stale cross-step table with the most (stage, micro-batch) exact gradients in budget.

    Chains that do not fit stop where no idle cell is left (nested groups, top stages first),
    as in the delayed policy; the split of the added ticks between warm-up and drain is searched.

    Example:
      >>> from jaxstream.pipeline import coverage_per_stage
      >>> coverage_per_stage(max_coverage(4, 4, (0, 1)))
      (0.25, 0.25, 0.5, 0.5)
    """
    M, N, sel = _check(num_stages, micro_batches, selected, added_ticks)
    s, _ = max(_candidates(M, N, sel, int(added_ticks)), key=lambda c: _score(*c))
    s.meta.update(added_ticks=int(added_ticks), lead=int(np.nonzero(s.kind[:, 0] == F)[0][0]))
    return s


def max_full_chains(num_stages: int, micro_batches: int, added_ticks: int = 0) -> int:
    """The most full stale chains that fit in forward-only GPipe plus ``added_ticks`` ticks."""
    M, N, _ = _check(num_stages, micro_batches, (), added_ticks)
    k = 0
    while k < N and any(all(r == 0 for r in low)
                        for _, low in _candidates(M, N, tuple(range(k + 1)), added_ticks)):
        k += 1
    return k


def min_added_ticks(num_stages: int, micro_batches: int, k: int) -> int:
    """The fewest ticks over N+M-1 with which k full stale chains fit (searched)."""
    M, N, _ = _check(num_stages, micro_batches, (), 0)
    if not 0 <= int(k) <= N:
        raise ValueError(f"k={k}; must be in 0..micro_batches={N}")
    a = 0
    while not any(all(r == 0 for r in low) for _, low in _candidates(M, N, tuple(range(k)), a)):
        a += 1
    return a
