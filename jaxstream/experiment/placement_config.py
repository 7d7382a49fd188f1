"""The pipeline engine's ``placement:`` section: how many blocks each stage holds.

``kind: equal`` (the default): depth / stages blocks per stage, so the stages must divide the
depth. ``kind: by_speed``: ``speeds`` (one per stage, relative) and the blocks split by
:func:`jaxstream.placement.place_stages` (a stack's blocks share one structure, so each costs
the same). ``kind: by_type``: seed 001's assignment (:func:`jaxstream.placement.assign_by_type`):
``layer_types`` labels each block, ``types`` maps each type to a device kind, ``devices`` is
stage s's kind, ``speeds`` each kind's rate and ``work`` each type's work per block (default 1).
Speeds are declared: measure them with :func:`jaxstream.placement.measure_kind_speeds` and write
them here, so that a run's stages do not move with timing noise.
Unequal stages run padded to the largest (:func:`jaxstream.pipeline.unequal_stages`). An
assignment whose stages are not consecutive runs of blocks in stage order is refused by name:
a micro-batch crosses the linear pipeline once.

Example (YAML):
  engine:
    type: pipeline
    stages: 3
    placement: {kind: by_type, layer_types: [dense, dense, dense, dense, dense, act, act],
                devices: [gpu, gpu, cpu], types: {dense: gpu, act: cpu},
                speeds: {gpu: 2.0, cpu: 1.0}}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import numpy as np

from jaxstream.placement import assign_by_type, place_stages
from jaxstream.ranges import Checked, Positive

KINDS = ("equal", "by_speed", "by_type")


@dataclasses.dataclass(frozen=True)
class PlacementConfig(Checked):
    """Blocks per pipeline stage (see the module doc).

    Attributes:
      kind: "equal", "by_speed" or "by_type".
      speeds: by_speed: one relative speed per stage; by_type: ``{device kind: speed}``.
      devices: by_type: stage s's device kind (one per stage).
      layer_types: by_type: each block's type (one per block of the model).
      types: by_type: ``{layer type: device kind}``.
      work: by_type: ``{layer type: work per block}`` (a type left out: 1).
    """

    kind: Literal["equal", "by_speed", "by_type"] = "equal"
    speeds: tuple[Positive, ...] | dict[str, Positive] | None = None
    devices: tuple[str, ...] | None = None
    layer_types: tuple[str, ...] | None = None
    types: dict[str, str] | None = None
    work: dict[str, Positive] | None = None

    def check(self) -> None:
        """Each kind's own fields are present and of the right shape; the others absent."""
        need = {"equal": (), "by_speed": ("speeds",),
                "by_type": ("speeds", "devices", "layer_types", "types")}[self.kind]
        for name in need:
            if getattr(self, name) is None:
                raise ValueError(f"{name}: missing; placement kind {self.kind!r} needs "
                                 f"{', '.join(need)}")
        for name in ("speeds", "devices", "layer_types", "types", "work"):
            if name not in need and not (name == "work" and self.kind == "by_type") \
                    and getattr(self, name) is not None:
                raise ValueError(f"{name}: not used by placement kind {self.kind!r} (it reads "
                                 f"{', '.join(need) or 'no other field'}); remove it")
        if self.kind == "by_speed" and not isinstance(self.speeds, tuple):
            raise ValueError(f"speeds: by_speed needs a list, one speed per stage; got "
                             f"{self.speeds!r}")
        if self.kind == "by_type":
            if not isinstance(self.speeds, Mapping):
                raise ValueError(f"speeds: by_type needs a mapping {{device kind: speed}}; got "
                                 f"{self.speeds!r}")
            for t, k in self.types.items():
                if k not in self.speeds:
                    raise ValueError(f"speeds: no speed for device kind {k!r} (of type {t!r}); "
                                     f"give speeds.{k}")
            for t in (*self.layer_types, *(self.work or {})):
                if t not in self.types:
                    raise ValueError(f"types: layer type {t!r} has no device kind; allowed "
                                     f"kinds: {sorted(set(self.devices))}")

    def sizes(self, depth: int, stages: int) -> tuple[int, ...]:
        """Blocks per stage for a model of ``depth`` blocks over ``stages`` stages.

        Raises:
          ValueError: naming ``engine.stages`` or ``engine.placement.<field>`` when this
            placement cannot serve that depth on that many stages.
        """
        field = "engine.placement"
        if self.kind == "equal":
            if depth % stages:
                raise ValueError(f"engine.stages: {stages} must divide model.depth = {depth} "
                                 f"(allowed: divisors of {depth}; for unequal stages set "
                                 f"engine.placement.kind to by_speed or by_type)")
            return (depth // stages,) * stages
        if depth < stages:
            raise ValueError(f"engine.stages: {stages} stages for model.depth = {depth} blocks; "
                             f"every stage needs a block (allowed: 1..{depth})")
        if self.kind == "by_speed":
            if len(self.speeds) != stages:
                raise ValueError(f"{field}.speeds: one speed per stage, {stages} (engine.stages)"
                                 f"; got {len(self.speeds)}")
            return tuple(place_stages(np.ones(depth), self.speeds).sizes)
        if len(self.devices) != stages:
            raise ValueError(f"{field}.devices: one device kind per stage, {stages} "
                             f"(engine.stages); got {len(self.devices)}")
        if len(self.layer_types) != depth:
            raise ValueError(f"{field}.layer_types: one type per block, {depth} (model.depth); "
                             f"got {len(self.layer_types)}")
        try:
            got = self.assign()
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
        if got.sizes is None:
            raise ValueError(
                f"{field}: by_type puts blocks on stages {list(got.stage_of)}; the pipeline "
                f"runs each stage's blocks as one consecutive run, stages in order (a "
                f"micro-batch crosses it once); order devices and layer_types so that each "
                f"kind's blocks are consecutive, or use kind: by_speed")
        return got.sizes

    def assign(self):
        """by_type: the seed's assignment of this section's blocks (a ``TypeAssignment``)."""
        work = [(self.work or {}).get(t, 1.0) for t in self.layer_types]
        rates = {(k, t): self.speeds[k] for t, k in self.types.items()}
        return assign_by_type(self.layer_types, work, self.devices, self.types, rates)
