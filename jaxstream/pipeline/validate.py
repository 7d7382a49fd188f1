"""Checks that a schedule table respects every dependency, and derives its stash lifetimes.

Rules (an error names the op, its stage and tick, and the missing dependency):
  - every stage runs F_j exactly once for every micro-batch j of the step;
  - F_j at stage s comes after F_j at stage s-1;
  - B_j / W_j / BW_j at stage s come once stage s holds the cotangent of its output: after the
    loss (F_j at the last stage) or after B_j at stage s+1; FBW only on the last stage;
  - at most one input-cotangent op and one weight-cotangent op per (stage, micro-batch);
  - the stash (stage inputs kept for B/W) never holds more than its capacity.

Example:
  >>> from jaxstream.pipeline import gpipe_forward, validate
  >>> validate(gpipe_forward(4, 8))
"""

from __future__ import annotations

import numpy as np

from jaxstream.pipeline.table import (
    BW,
    COT_OPS,
    FBW,
    GRAD_OPS,
    IDLE,
    OP_NAMES,
    B,
    F,
    Schedule,
    W,
)


class ScheduleError(ValueError):
    """A schedule table breaks a dependency or a limit."""


def _op(kind: int, j: int, stale: bool) -> str:
    return f"{OP_NAMES[kind]}_{j}" + (" (previous step)" if stale else "")


def forward_ticks(s: Schedule) -> np.ndarray:
    """(M, N) tick of F_j (or FBW_j) at each stage; -1 where missing."""
    out = np.full((s.num_stages, s.micro_batches), -1, np.int64)
    for t, st, k, j, _ in s.cells():
        if k in (F, FBW) and 0 <= j < s.micro_batches:
            out[st, j] = t
    return out


def stash_intervals(s: Schedule) -> list[list[tuple[int, int, int, bool]]]:
    """Per stage, the (first tick, last tick, j, stale) during which a stage input is stashed.

    A stage input is stashed from its F until its last B/W/BW; an input the next step's stale ops
    need is kept to the end of the table, and a stale input is held from tick 0.
    """
    fwd = forward_ticks(s)
    last: dict[tuple[int, int, bool], int] = {}
    for t, st, k, j, stale in s.cells():
        if k in (B, W, BW):
            last[(st, j, stale)] = max(t, last.get((st, j, stale), -1))
    out: list[list[tuple[int, int, int, bool]]] = [[] for _ in range(s.num_stages)]
    end = s.num_ticks - 1
    for (st, j, stale), t_last in sorted(last.items()):
        if stale:
            out[st].append((0, t_last, j, True))
        else:
            out[st].append((int(fwd[st, j]), t_last, j, False))
    for (st, j, stale) in sorted(last):
        if stale:  # the current step's j is carried over to the next step
            out[st].append((int(fwd[st, j]), end, j, False))
    return out


def peak_stash(s: Schedule) -> np.ndarray:
    """(M,) the most stage inputs each stage holds at once."""
    peaks = np.zeros(s.num_stages, np.int64)
    for st, ivs in enumerate(stash_intervals(s)):
        live = np.zeros(max(s.num_ticks, 1), np.int64)
        for a, b, _, _ in ivs:
            live[a : b + 1] += 1
        peaks[st] = int(live.max()) if ivs else 0
    return peaks


def validate(s: Schedule) -> None:
    """Raises ScheduleError naming the first broken rule; returns None for a valid table."""
    _check_shape(s)
    fwd, cot = _check_ops(s)
    _check_order(s, fwd, cot)
    if s.stash_capacity is not None:
        peaks = peak_stash(s)
        if peaks.max(initial=0) > s.stash_capacity:
            st = int(np.argmax(peaks))
            raise ScheduleError(f"stage {st}: the stash holds {peaks[st]} stage inputs; "
                                f"stash_capacity={s.stash_capacity}")


def _check_shape(s: Schedule) -> None:
    """Sizes, codes, micro-batch indices, and which ops may be stale."""
    M, N = s.num_stages, s.micro_batches
    if N < 1:
        raise ScheduleError(f"micro_batches={N}; must be >= 1")
    if M < 1:
        raise ScheduleError(f"the table has {M} stages; must be >= 1")
    for name, arr in (("micro", s.micro), ("stale", s.stale)):
        if arr.shape != s.kind.shape:
            raise ScheduleError(f"{name} has shape {arr.shape}; expected {s.kind.shape}")
    if s.kind.min(initial=0) < 0 or s.kind.max(initial=0) > FBW:
        raise ScheduleError(f"kind holds codes outside 0..{FBW} ({OP_NAMES})")
    busy = s.kind != IDLE
    if np.any(busy & ((s.micro < 0) | (s.micro >= N))):
        t, st = np.argwhere(busy & ((s.micro < 0) | (s.micro >= N)))[0]
        raise ScheduleError(
            f"stage {st} tick {t}: micro-batch {s.micro[t, st]} outside 0..{N - 1}")
    bad = s.stale & ~np.isin(s.kind, (B, W, BW))
    if bad.any():
        t, st = np.argwhere(bad)[0]
        raise ScheduleError(f"stage {st} tick {t}: only B, W, BW may be stale "
                            f"(previous step); got {OP_NAMES[s.kind[t, st]]}")


def _check_ops(s: Schedule) -> tuple[np.ndarray, dict]:
    """Each op at most once per (stage, micro-batch), FBW on the last stage, every F present;
    returns the F ticks (M, N) and the input-cotangent ticks by (stage, j, stale)."""
    M, N = s.num_stages, s.micro_batches
    fwd = np.full((M, N), -1, np.int64)
    cot: dict[tuple[int, int, bool], int] = {}
    wgt: dict[tuple[int, int, bool], int] = {}
    for t, st, k, j, stale in s.cells():
        if k == FBW and st != M - 1:
            raise ScheduleError(f"stage {st} tick {t}: FBW_{j} is only allowed on the last "
                                f"stage ({M - 1}), where the loss is")
        if k in (F, FBW):
            if fwd[st, j] >= 0:
                raise ScheduleError(f"stage {st}: F_{j} runs twice (ticks {fwd[st, j]} and {t})")
            fwd[st, j] = t
        for ops, seen, what in ((COT_OPS, cot, "input"), (GRAD_OPS, wgt, "weight")):
            if k in ops:
                if (st, j, stale) in seen:
                    raise ScheduleError(f"stage {st} tick {t}: {_op(k, j, stale)} repeats the "
                                        f"{what} cotangent of tick {seen[(st, j, stale)]}")
                seen[(st, j, stale)] = t
    missing = np.argwhere(fwd < 0)
    if missing.size:
        st, j = missing[0]
        raise ScheduleError(f"stage {st}: micro-batch {j} has no F op (every stage runs F_j "
                            f"once for every j in 0..{N - 1})")
    return fwd, cot


def _check_order(s: Schedule, fwd: np.ndarray, cot: dict) -> None:
    """F_j after its input; B/W/BW after the loss or the cotangent from the stage above, and
    after their own stage's F."""
    M, N = s.num_stages, s.micro_batches
    for st in range(1, M):
        for j in range(N):
            if fwd[st, j] <= fwd[st - 1, j]:
                raise ScheduleError(
                    f"stage {st} tick {fwd[st, j]}: F_{j} runs before its input exists "
                    f"(F_{j} at stage {st - 1} is at tick {fwd[st - 1, j]})")
    for t, st, k, j, stale in s.cells():
        if k not in (B, W, BW):
            continue
        if st == M - 1:
            if not stale and fwd[st, j] >= t:
                raise ScheduleError(
                    f"stage {st} tick {t}: {_op(k, j, stale)} needs the loss of F_{j} on the last "
                    f"stage, which runs at tick {fwd[st, j]}")
            continue
        up = cot.get((st + 1, j, stale))
        if up is None or up >= t:
            where = "never runs" if up is None else f"runs at tick {up}"
            raise ScheduleError(
                f"stage {st} tick {t}: {_op(k, j, stale)} needs the cotangent from "
                f"B_{j} at stage {st + 1}, which {where}")
        if not stale and fwd[st, j] >= t:
            raise ScheduleError(f"stage {st} tick {t}: {_op(k, j, stale)} runs before F_{j} "
                                f"at this stage (tick {fwd[st, j]})")
