"""Lowers a validated schedule table into the per-(tick, stage) integer tables the executor reads.

The executor keeps, on each stage, ring buffers of slots: stage inputs (from arrival until F, and
until the last B/W for selected micro-batches: this is the stash), input tangents (arrival to F)
and output cotangents (arrival to the last B/W). Slots are assigned here by interval colouring,
so buffer sizes are the peak number of items alive, not N. Every ppermute'd value is stored on
arrival; values nobody needs go to a scratch slot (the last one).

Example:
  >>> from jaxstream.pipeline import gpipe_forward
  >>> lower(gpipe_forward(4, 8)).h_slots
  1
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxstream.pipeline.table import BW, COT_OPS, FBW, IDLE, B, F, Schedule, W
from jaxstream.pipeline.validate import forward_ticks, validate


class Row(NamedTuple):
    """The integer fields of one (tick, stage) cell of a lowered table. Slots index the stage's
    ring buffers; the last slot of every buffer is scratch (written to, never read).

    Attributes:
      branch: the ``lax.switch`` branch the cell runs (:attr:`Lowered.branches`; 0 is idle).
      mb: the op's micro-batch (its data and its tangent key).
      h_w: slot that stores the activation arriving from the stage below this tick.
      t_w: slot that stores the activation tangents arriving with it.
      c_w: slot that stores the cotangent arriving from the stage above this tick.
      h_r: slot of the stage input the op reads.
      t_r: slot of the input tangents the op reads.
      c_r: slot of the output cotangent the op reads.
      ns_w: stash slot for this step's input of a micro-batch the next step corrects (stale).
      pm_r: stash slot of the previous step's input that a stale op reads.
      d_w: row of the loss / directional-derivative accumulators written (last stage's F).
      g_w: row of the exact-gradient accumulator a weight-gradient op adds to.
    """

    branch: int
    mb: int
    h_w: int
    t_w: int
    c_w: int
    h_r: int
    t_r: int
    c_r: int
    ns_w: int
    pm_r: int
    d_w: int
    g_w: int


FIELDS = Row._fields


class Lowered(NamedTuple):
    """Static tables of one schedule, ready for the executor.

    Attributes:
      branches: (kind, position, stale) of each lax.switch branch; branch 0 is idle.
      tables: (T, M, len(FIELDS)) int32, one :class:`Row` per tick and stage.
      h_slots, t_slots, c_slots: buffer slots per stage (a scratch slot comes on top).
      prev_selected: the previous step's micro-batches the table corrects (delayed policy).
      selected: the micro-batches with any exact gradient (of the previous step if stale);
        exact gradients are accumulated per rank in this tuple.
      groups: (M, k) bool, True where stage s has the exact gradient of selected[i].
      stale: the exact gradients are of the previous step's micro-batches.
      backward: the table has B/W work (so cotangents travel).
    """

    branches: tuple
    tables: np.ndarray
    h_slots: int
    t_slots: int
    c_slots: int
    prev_selected: tuple
    selected: tuple
    groups: np.ndarray
    stale: bool
    backward: bool


def position(stage: int, num_stages: int) -> str:
    """"first", "mid", "last" or "only" (a single stage)."""
    if num_stages == 1:
        return "only"
    return "first" if stage == 0 else "last" if stage == num_stages - 1 else "mid"


def _colour(items: list[tuple[int, int, object]]) -> tuple[dict, int]:
    """Interval colouring: {item id: slot}, number of slots; a slot is reused only after its end."""
    ends: list[int] = []
    out = {}
    for start, end, ident in sorted(items, key=lambda x: (x[0], x[1])):
        for k, e in enumerate(ends):
            if e < start:
                ends[k] = end
                out[ident] = k
                break
        else:
            out[ident] = len(ends)
            ends.append(end)
    return out, len(ends)


def lower(s: Schedule) -> Lowered:
    """Validates `s` and builds the executor's tables (see Lowered)."""
    validate(s)
    M, N = s.num_stages, s.micro_batches
    if s.stale.any() and np.isin(s.kind[~s.stale], (B, W, BW, FBW)).any():
        raise ValueError("a table may hold exact-gradient ops of this step or of the previous "
                         "step (stale), not both")
    fwd = forward_ticks(s)
    cot_tick, last_use = _uses(s)
    prev_sel = tuple(sorted({j for (_, j, stl) in last_use if stl}))
    selected = tuple(sorted({j for _, _, k, j, _ in s.cells() if k in (W, BW, FBW)}))
    slots = _slots(M, N, fwd, cot_tick, last_use)
    branches, tab = _tables(s, slots, last_use, prev_sel, selected)
    g_rank = {j: r for r, j in enumerate(selected)}
    groups = np.zeros((M, len(selected)), bool)
    for _, st, k, j, _ in s.cells():
        if k in (W, BW, FBW):
            groups[st, g_rank[j]] = True
    h_n, t_n, c_n = (max(n for _, n in per) for per in slots)
    return Lowered(tuple(branches), tab, h_n, t_n, c_n, prev_sel, selected, groups,
                   bool(s.stale.any()), bool(np.isin(s.kind, (B, W, BW, FBW)).any()))


def _uses(s: Schedule) -> tuple[dict, dict]:
    """(tick of each input-cotangent op, last tick of each B/W/BW) by (stage, j, stale)."""
    cot_tick: dict[tuple[int, int, bool], int] = {}
    last_use: dict[tuple[int, int, bool], int] = {}
    for t, st, k, j, stl in s.cells():
        if k in COT_OPS:
            cot_tick[(st, j, stl)] = t
        if k in (B, W, BW):
            last_use[(st, j, stl)] = max(t, last_use.get((st, j, stl), -1))
    return cot_tick, last_use


def _slots(M: int, N: int, fwd: np.ndarray, cot_tick: dict, last_use: dict) -> tuple:
    """Per buffer (inputs, tangents, cotangents), per stage: ({item: slot}, slots used)."""
    h_slot, t_slot, c_slot = [], [], []
    for st in range(M):
        hs, ts, cs = [], [], []
        if st > 0:
            for j in range(N):
                a = int(fwd[st - 1, j]) + 1
                end = max(int(fwd[st, j]), last_use.get((st, j, False), -1))
                hs.append((a, end, j))
                ts.append((a, int(fwd[st, j]), j))
        if st < M - 1:
            for (s2, j, stl), t_up in cot_tick.items():
                if s2 == st + 1 and (st, j, stl) in last_use:
                    cs.append((t_up + 1, last_use[(st, j, stl)], (j, stl)))
        for items, acc in ((hs, h_slot), (ts, t_slot), (cs, c_slot)):
            acc.append(_colour(items))
    return h_slot, t_slot, c_slot


def _tables(s: Schedule, slots: tuple, last_use: dict, prev_sel: tuple,
            selected: tuple) -> tuple[list, np.ndarray]:
    """The switch branches used and the (T, M, len(FIELDS)) table of :class:`Row` s."""
    M, N, T = s.num_stages, s.micro_batches, s.num_ticks
    h_slot, t_slot, c_slot = slots
    h_n, t_n, c_n = (max(n for _, n in per) for per in slots)
    rank = {j: r for r, j in enumerate(prev_sel)}
    g_rank = {j: r for r, j in enumerate(selected)}
    branches: list[tuple] = [(IDLE, "any", False)]
    tab = np.zeros((T, M, len(FIELDS)), np.int32)
    col = {f: i for i, f in enumerate(FIELDS)}
    scratch = {"h_w": h_n, "h_r": h_n, "t_w": t_n, "t_r": t_n, "c_w": c_n, "c_r": c_n,
               "ns_w": len(prev_sel), "pm_r": len(prev_sel), "d_w": N, "g_w": len(selected)}
    for name, slot in scratch.items():
        tab[..., col[name]] = slot
    for t, st, k, j, stl in s.cells():
        key = (k, position(st, M), stl)
        if key not in branches:
            branches.append(key)
        row = tab[t, st]
        row[col["branch"]], row[col["mb"]] = branches.index(key), j
        if st > 0 and not stl:
            row[col["h_r"]] = h_slot[st][0][j]
        if k in (F, FBW):
            if st > 0:
                row[col["t_r"]] = t_slot[st][0][j]
            if st == M - 1:
                row[col["d_w"]] = j
            if j in rank and (st, j, True) in last_use and st > 0:
                row[col["ns_w"]] = rank[j]
        if stl:
            row[col["pm_r"]] = rank[j]
        if k in (W, BW, FBW):
            row[col["g_w"]] = g_rank[j]
        if k in (B, W, BW) and st < M - 1:
            row[col["c_r"]] = c_slot[st][0][(j, stl)]
    # arrivals: what stage st-1 sent up at tick t-1, what stage st+1 sent down at tick t-1
    for t, st, k, j, stl in s.cells():
        if t + 1 >= T:
            continue
        if k == F and st < M - 1:
            tab[t + 1, st + 1, col["h_w"]] = h_slot[st + 1][0][j]
            tab[t + 1, st + 1, col["t_w"]] = t_slot[st + 1][0][j]
        if k in COT_OPS and st > 0 and (st - 1, j, stl) in last_use:
            tab[t + 1, st - 1, col["c_w"]] = c_slot[st - 1][0][(j, stl)]
    return branches, tab


def exact_from(s: Schedule, num_layers: int) -> tuple[int, ...]:
    """The single-device hybrid estimator's ``exact_from`` for the groups a table produces.

    Micro-batch n's first block with an exact gradient is the first layer of the lowest stage
    whose group holds n (groups are nested); L + 1 where no stage has it.

    Example:
      >>> from jaxstream.pipeline import complete
      >>> exact_from(complete(2, 3, (1,)), num_layers=4)
      (5, 0, 5)
    """
    lowered = lower(s)
    M, per = s.num_stages, num_layers // s.num_stages
    out = [num_layers + 1] * s.micro_batches
    for i, j in enumerate(lowered.selected):
        stages = np.nonzero(lowered.groups[:, i])[0]
        if not np.array_equal(stages, np.arange(stages[0], M)):
            raise ValueError(f"micro-batch {j}: its exact gradients reach stages {list(stages)}, "
                             f"which are not the nested top stages {stages[0]}..{M - 1}")
        out[j] = int(stages[0]) * per
    return tuple(out)
