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

from jaxstream.experiment.data_configs import DataConfig, DigitsDataConfig
from jaxstream.experiment.engines import EngineConfig, LocalEngineConfig
from jaxstream.experiment.estimators import BackpropConfig, EstimatorConfig
from jaxstream.experiment.model_configs import MLPConfig, ModelConfig
from jaxstream.experiment.optimizers import OptimizerConfig, check_optimizer


@dataclasses.dataclass(frozen=True)
class ArmConfig:
    """One estimator to train and compare.

    Attributes:
      name: label in metrics, tables and plots (unique within the experiment).
      estimator: the estimator section (``type: backprop | forward | hybrid``).
      lr: learning rate.
      optimizer: overrides the experiment's optimizer for this arm.
    """

    name: str = "backprop"
    estimator: EstimatorConfig = dataclasses.field(default_factory=BackpropConfig)
    lr: float = 1e-3
    optimizer: OptimizerConfig | None = None

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"name: must be a non-empty label without '/', got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
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

    seed: int = 0
    steps: int = 300
    max_steps: int | None = None
    batch_size: int = 64
    eval_every: int = 25
    diag_every: int = 50
    checkpoint_every: int = 100
    target_accuracy: float = 0.95
    model: ModelConfig = dataclasses.field(default_factory=MLPConfig)
    data: DataConfig = dataclasses.field(default_factory=DigitsDataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    engine: EngineConfig = dataclasses.field(default_factory=LocalEngineConfig)
    arms: tuple[ArmConfig, ...] = (ArmConfig(),)
    plots: bool = True
    progress: bool = True

    def __post_init__(self):
        if self.seed < 0:
            raise ValueError(f"seed: must be >= 0, got {self.seed}")
        if not 0.0 < self.target_accuracy <= 1.0:  # 0 is reached before the first step
            raise ValueError(f"target_accuracy: must be in (0, 1], got {self.target_accuracy}")
        for name in ("steps", "batch_size", "eval_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("diag_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1 or null, got {self.max_steps}")
        if not self.arms:
            raise ValueError("arms: list at least one arm")
        names = [a.name for a in self.arms]
        for i, arm in enumerate(self.arms):
            if names.index(arm.name) != i:
                raise ValueError(f"arms.{i}.name: {arm.name!r} is used twice; names must be unique")
            n = getattr(arm.estimator, "micro_batches", 1)
            if self.batch_size % n:
                raise ValueError(f"arms.{i}.estimator.micro_batches: batch_size={self.batch_size}"
                                 f" is not divisible by micro_batches={n}")
            if arm.optimizer is not None:
                check_optimizer(arm.optimizer, f"arms.{i}.optimizer")
            self.engine.check_arm(arm, f"arms.{i}")  # engine/estimator compatibility
            self.engine.check_optimizer(
                self.arm_optimizer(arm),
                f"arms.{i}.optimizer" if arm.optimizer is not None else "optimizer")
        check_optimizer(self.optimizer, "optimizer")
        self.engine.check_arms(names)
        self.engine.check_model(self.model)  # e.g. depth against stages

    def check_run(self, resume: bool) -> None:
        """Checks that need the machine or the disk, before anything is written: the memory
        estimate of the model against the machine's memory, and the engine's own checks
        (e.g. a new run must not reuse an existing layer store)."""
        streamed = self.engine.streams_layers
        estimate = getattr(self.model, "memory_estimate", None)
        if estimate is not None:
            need = estimate(self.batch_size, per_layer=streamed)
            have = machine_memory()
            if need > have:
                raise ValueError(
                    f"model: needs about {need / 2**30:.3g} GiB ({'one streamed layer' if streamed else 'parameters'}"
                    f" with optimizer state, plus activations of batch_size={self.batch_size}); "
                    f"this machine has {have / 2**30:.3g} GiB of memory; make the model smaller")
        self.engine.check_run([a.name for a in self.arms], resume)

    def arm_optimizer(self, arm: ArmConfig) -> OptimizerConfig:
        """The optimizer section that applies to ``arm``."""
        return arm.optimizer if arm.optimizer is not None else self.optimizer


def machine_memory() -> int:
    """Physical memory of this machine in bytes."""
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
