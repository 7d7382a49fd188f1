"""The config of a ``kind: train`` experiment: model, data, engine and one or more *arms*.

An arm is an estimator + learning rate (+ optionally its own optimizer) trained from the same
initial params on the same batches as the other arms, so arms compare like for like.

Example (YAML):
    model: {type: mlp, width: 64, depth: 2}
    steps: 300
    arms:
      - {name: backprop, estimator: {type: backprop}, lr: 0.003}
      - {name: forward, estimator: {type: forward, num_tangents: 4}, lr: 0.0003}
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from jaxstream.experiment.data_configs import DataConfig, DigitsDataConfig
from jaxstream.experiment.engines import EngineConfig, LocalEngineConfig
from jaxstream.experiment.estimators import BackpropConfig, EstimatorConfig
from jaxstream.experiment.model_configs import MLPConfig, ModelConfig
from jaxstream.experiment.optimizers import OptimizerConfig, check_optimizer
from jaxstream.ranges import Checked, Count, Every, Positive, Probability, Seed


@dataclasses.dataclass(frozen=True)
class ArmConfig(Checked):
    """One estimator to train and compare.

    Attributes:
      name: label in metrics, tables and plots (unique within the experiment).
      estimator: the estimator section (``type: backprop | forward | hybrid``).
      lr: learning rate.
      optimizer: overrides the experiment's optimizer for this arm.
    """

    name: str = "backprop"
    estimator: EstimatorConfig = dataclasses.field(default_factory=BackpropConfig)
    lr: Positive = 1e-3
    optimizer: OptimizerConfig | None = None

    def check(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"name: must be a non-empty label without '/', got {self.name!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Checked):
    """A training experiment.

    Attributes:
      seed: seeds the initial params, the data split, the batch order and the tangents.
      steps: optimizer steps per arm.
      max_steps: stop every arm after this many steps (a checkpoint is written); ``--resume``
        later continues to ``steps``. Does not change any metric.
      batch_size: examples per step (divisible by a hybrid arm's micro_batches).
      eval_every: log train/test loss and accuracy every this many steps (and at the end).
      diag_every: log the cosine of the estimate to the exact gradient every this many steps
        (0: never).
      checkpoint_every: write an orbax checkpoint every this many steps (0: only at the end).
      target_accuracy: the test accuracy whose first crossing the summary reports.
      model, data, optimizer, engine: the corresponding sections.
      arms: the estimators to compare.
      plots: write PNG plots.
      progress: show a progress bar (on a terminal).
    """

    seed: Seed = 0
    steps: Count = 300
    max_steps: Count | None = None
    batch_size: Count = 64
    eval_every: Count = 25
    diag_every: Every = 50
    checkpoint_every: Every = 100
    target_accuracy: Probability = 0.95  # 0 is reached before the first step
    model: ModelConfig = dataclasses.field(default_factory=MLPConfig)
    data: DataConfig = dataclasses.field(default_factory=DigitsDataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    engine: EngineConfig = dataclasses.field(default_factory=LocalEngineConfig)
    arms: tuple[ArmConfig, ...] = (ArmConfig(),)
    plots: bool = True
    progress: bool = True

    def check(self) -> None:
        if self.max_steps is not None and self.max_steps > self.steps:
            raise ValueError(f"max_steps: stops before steps = {self.steps}, so at most "
                             f"{self.steps} (or null), got {self.max_steps}")
        if not self.arms:
            raise ValueError("arms: list at least one arm")
        names = [a.name for a in self.arms]
        for i, arm in enumerate(self.arms):
            if names.index(arm.name) != i:
                raise ValueError(f"arms.{i}.name: {arm.name!r} is used twice; names must be unique")
            what, n = arm.estimator.batch_divisor()
            field = f"arms.{i}.estimator"
            if n == 1 and self.engine.micro_batches > 1:  # the engine's N
                what, n, field = "micro_batches", self.engine.micro_batches, "engine"
            if self.batch_size % n:
                raise ValueError(f"{field}.{what}: batch_size={self.batch_size}"
                                 f" is not divisible by {what}={n}")
            if arm.optimizer is not None:
                check_optimizer(arm.optimizer, f"arms.{i}.optimizer")
            self.engine.check_arm(arm, f"arms.{i}")  # engine/estimator compatibility
            self.engine.check_optimizer(
                self.arm_optimizer(arm),
                f"arms.{i}.optimizer" if arm.optimizer is not None else "optimizer")
        check_optimizer(self.optimizer, "optimizer")
        for field, opt in (("optimizer", self.optimizer), *((f"arms.{i}.optimizer", a.optimizer)
                                                          for i, a in enumerate(self.arms))):
            if opt is not None and opt.warmup_steps > self.steps:
                raise ValueError(f"{field}.warmup_steps: the warm-up must end within steps = "
                                 f"{self.steps}, got {opt.warmup_steps}")
        self.engine.check_arms(names)
        self.engine.check_model(self.model)  # e.g. depth against stages

    def check_run(self, resume: bool) -> None:
        """Checks that need the machine or the disk, before anything is written: the memory
        estimate of the model against the machine's memory, and the engine's own checks
        (e.g. a new run must not reuse an existing layer store)."""
        check_memory(self.model, self.batch_size, streamed=self.engine.streams_layers,
                     tangents=max_tangents(a.estimator for a in self.arms),
                     named={"tangents": tangents_field(self.arms)})
        if self.engine.streams_layers:
            check_disk(self.model, self.engine.location(self.arms[0].name))
        self.data.check_batch(self.batch_size, self.seed)
        self.engine.check_run([a.name for a in self.arms], resume)

    def arm_optimizer(self, arm: ArmConfig) -> OptimizerConfig:
        """The optimizer section that applies to ``arm``."""
        return arm.optimizer if arm.optimizer is not None else self.optimizer


def check_memory(model: Any, batch_size: int, lanes: int = 1, streamed: bool = False,
                 tangents: int = 1, field: str = "model", named: dict | None = None) -> None:
    """Refuse a model whose memory estimate (its parameters with optimizer state, or one
    streamed layer, plus activations of ``batch_size`` and the ``tangents`` a jvp holds;
    ``lanes`` copies trained side by side) exceeds this machine's memory, naming ``field``
    and, after each size, the config fields that set it (``named``: ``"batch"``,
    ``"tangents"``, ``"lanes"`` → a field), before anything is written."""
    named = {k: f" ({v})" for k, v in (named or {}).items() if v}
    estimate = getattr(model, "memory_estimate", None)
    if estimate is None:
        return
    need = lanes * estimate(batch_size, per_layer=streamed, tangents=tangents)
    have = machine_memory()
    if need > have:
        what = "one streamed layer" if streamed else "parameters"
        extra = "".join([
            f", {tangents} tangents{named.get('tangents', '')}" if tangents > 1 else "",
            f", {lanes} lanes side by side{named.get('lanes', '')}" if lanes > 1 else ""])
        raise ValueError(f"{field}: needs about {need / 2**30:.3g} GiB ({what} with optimizer "
                         f"state, plus activations of batch_size={batch_size}"
                         f"{named.get('batch', '')}{extra}); this "
                         f"machine has {have / 2**30:.3g} GiB of memory; make the model smaller"
                         f"{', or use fewer lanes' if lanes > 1 else ''}"
                         f"{' or fewer tangents' if tangents > 1 else ''}")


def check_disk(model: Any, where: str | None, field: str = "model") -> None:
    """Refuse a streamed model whose layer store cannot fit on the disk at ``where`` (a local
    path; None: the current directory, where run directories go by default): fp32 parameters
    and two optimizer moments, in the store's two slots, of the blocks (a lower bound)."""
    count = getattr(model, "block_params", None)
    if count is None or (where is not None and "://" in where):
        return
    need = 4 * 3 * 2 * count()
    path = Path(where or ".").absolute()
    while not path.exists():
        path = path.parent
    have = shutil.disk_usage(path).free
    if need > have:
        raise ValueError(f"{field}: its layer store needs about {need / 2**30:.3g} GiB and {path} "
                         f"has {have / 2**30:.3g} GiB free; make the model smaller or put "
                         f"engine.store on a larger disk")


def max_tangents(estimators: Any) -> int:
    """The most jvp tangents any of ``estimators`` (config sections) draws at once."""
    return max([e.num_tangents for e in estimators] + [1])


def tangents_field(arms: Any, prefix: str = "arms") -> str | None:
    """The dotted field of the arm whose estimator draws the most tangents (None: none draws
    more than one), for an error to name."""
    counts = [a.estimator.num_tangents for a in arms]
    if not counts or max(counts) <= 1:
        return None
    return f"{prefix}.{counts.index(max(counts))}.estimator.num_tangents"


def machine_memory() -> int:
    """Physical memory of this machine in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
