"""Dynamic depth: which stored layers a step runs (stochastic depth, progressive stacking).

Because layers stream one at a time, a step may run any subset of the stored layers in order;
skipped layers are neither read nor written that step (a skipped block acts as the identity,
which suits residual blocks).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from jaxstream.ranges import Checked, Count, Probability, Seed

KINDS = ("all", "stochastic", "progressive")


@dataclasses.dataclass(frozen=True)
class DepthPolicy(Checked):
    """Names the layers of each step.

    Attributes:
      kind: "all" (every layer), "stochastic" (each layer kept with ``keep_prob``, at least
        one kept; the choice is a pure function of ``seed`` and the step), or "progressive"
        (the first ``start`` layers, ``grow`` more every ``every`` steps).
      keep_prob: survival probability of a layer (stochastic).
      start, grow, every: progressive stacking schedule.
      seed: seed of the stochastic choice.

    Example:
      >>> DepthPolicy("progressive", start=2, grow=1, every=10).layers(step=25, num_layers=8)
      (0, 1, 2, 3)
    """

    kind: Literal["all", "stochastic", "progressive"] = "all"
    keep_prob: Probability = 0.8
    start: Count = 1
    grow: Count = 1
    every: Count = 100
    seed: Seed = 0

    def layers(self, step: int, num_layers: int) -> tuple[int, ...]:
        """The ordered global layer indices run at ``step``."""
        if self.kind == "all":
            return tuple(range(num_layers))
        if self.kind == "progressive":
            k = min(num_layers, self.start + self.grow * (int(step) // self.every))
            return tuple(range(k))
        rng = np.random.default_rng([self.seed, int(step)])
        keep = rng.random(num_layers) < self.keep_prob
        if not keep.any():
            keep[rng.integers(num_layers)] = True
        return tuple(int(i) for i in np.flatnonzero(keep))
