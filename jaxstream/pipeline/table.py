"""Pipeline schedules as plain (ticks x stages) tables of ops (NumPy only, no JAX).

Op kinds:
  IDLE  nothing;
  F     jvp forward of micro-batch j (activations and tangents move one stage up);
  B     input cotangent of micro-batch j (the cotangent moves one stage down);
  W     weight cotangent of micro-batch j (the exact gradient of the stage's parameters);
  BW    B and W fused in one op;
  FBW   F, then B and W from the loss in the same op (last stage only, where the loss lives).

An op may be *stale*: it belongs to the previous step's micro-batch j (the delayed policy), whose
stage input was stashed during the previous step.

Example:
  >>> s = Schedule.from_ops(2, 2, [[("F", 0), None], [("F", 1), ("F", 0)], [None, ("F", 1)]])
  >>> s.num_ticks, s.num_stages
  (3, 2)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IDLE, F, B, W, BW, FBW = 0, 1, 2, 3, 4, 5
OP_NAMES = ("-", "F", "B", "W", "BW", "FBW")
OP_CODES = {name: code for code, name in enumerate(OP_NAMES)}
BACKWARD_OPS = (B, W, BW)  # ops that fill idle slots with reverse-mode work
GRAD_OPS = (W, BW, FBW)  # ops that produce a stage's exact weight gradient
COT_OPS = (B, BW, FBW)  # ops that send an input cotangent one stage down


@dataclass(frozen=True, eq=False)
class Schedule:
    """A (ticks x stages) op table.

    Attributes:
      kind: int8 (T, M) op codes (IDLE, F, B, W, BW, FBW).
      micro: int32 (T, M) micro-batch index of each op, -1 where idle.
      stale: bool (T, M) True where the op belongs to the previous step's micro-batch.
      micro_batches: N, the micro-batches per step.
      name: a label used in tables and plots (stale policies say so in their name).
      stash_capacity: the most stage inputs a stage may hold for B/W, None for no limit.
    """

    kind: np.ndarray
    micro: np.ndarray
    stale: np.ndarray
    micro_batches: int
    name: str = "custom"
    stash_capacity: int | None = None
    meta: dict = field(default_factory=dict)

    @property
    def num_ticks(self) -> int:
        return int(self.kind.shape[0])

    @property
    def num_stages(self) -> int:
        return int(self.kind.shape[1])

    @property
    def is_stale(self) -> bool:
        """True when some op uses the previous step's micro-batches (results are one step old)."""
        return bool(self.stale.any())

    @classmethod
    def empty(cls, num_ticks: int, num_stages: int, micro_batches: int, **kw) -> Schedule:
        """An all-idle table."""
        return cls(
            kind=np.zeros((num_ticks, num_stages), np.int8),
            micro=np.full((num_ticks, num_stages), -1, np.int32),
            stale=np.zeros((num_ticks, num_stages), bool),
            micro_batches=micro_batches,
            **kw,
        )

    @classmethod
    def from_ops(cls, num_stages: int, micro_batches: int, rows, **kw) -> Schedule:
        """Builds a table from rows of cells: None (idle), (name, j) or (name, j, stale)."""
        s = cls.empty(len(rows), num_stages, micro_batches, **kw)
        for t, row in enumerate(rows):
            if len(row) != num_stages:
                raise ValueError(f"rows[{t}] has {len(row)} cells; expected num_stages={num_stages}")
            for st, cell in enumerate(row):
                if cell is None:
                    continue
                name, j, *rest = cell
                if name not in OP_CODES or name == "-":
                    raise ValueError(f"rows[{t}][{st}]: op {name!r}; allowed: {OP_NAMES[1:]}")
                s.kind[t, st] = OP_CODES[name]
                s.micro[t, st] = j
                s.stale[t, st] = bool(rest[0]) if rest else False
        return s

    def cells(self):
        """Yields (tick, stage, kind, micro, stale) for every non-idle cell, in tick order."""
        for t, st in zip(*np.nonzero(self.kind)):
            yield int(t), int(st), int(self.kind[t, st]), int(self.micro[t, st]), bool(
                self.stale[t, st]
            )

    def with_capacity(self, stash_capacity: int | None) -> Schedule:
        """A copy with another stash capacity."""
        return Schedule(self.kind, self.micro, self.stale, self.micro_batches, self.name,
                        stash_capacity, dict(self.meta))
