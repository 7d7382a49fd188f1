"""The config of a ``kind: finetune`` experiment: pretrain in memory, fine-tune from a store.

A model is pretrained by backprop in memory on one data set (``pretrain:``); its parameters are
the initial parameters of every arm, which fine-tunes them on another data set read from a data
store (``data_store:``, written from ``source:`` when it does not exist yet). Each arm names its
own engine, so a forward arm streamed from a layer store, the same arm in memory and a
backprop arm streamed from a store train side by side, on the same batches.

Example (YAML):
    model: {type: char_transformer, d_model: 64, depth: 4}
    pretrain: {data: {type: text, corpus: a}, steps: 20, lr: 0.001}
    source: {type: text, corpus: b}
    arms:
      - name: forward_stream
        estimator: {type: forward, perturb: weights}
        engine: {type: stream, compute_dtype: bfloat16, update: lazy, rewrite_every: 2}
      - name: forward_memory
        estimator: {type: forward, perturb: weights}
        engine: {type: local}
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxstream.data.stored import INFO
from jaxstream.experiment.data_configs import DataConfig, StoreDataConfig, TextDataConfig
from jaxstream.experiment.engine_stream import StreamEngineConfig
from jaxstream.experiment.engines import EngineConfig, LocalEngineConfig
from jaxstream.experiment.model_configs import CharTransformerConfig, ModelConfig
from jaxstream.experiment.optimizers import OptimizerConfig, check_optimizer
from jaxstream.experiment.train_config import ArmConfig, TrainConfig, check_disk, check_memory
from jaxstream.ranges import Checked, Count, Positive, Seed


@dataclasses.dataclass(frozen=True)
class PretrainConfig(Checked):
    """Backprop (Adam) in memory before the fine-tune.

    Attributes:
      data: the pretraining data (the first standard-library text by default).
      steps: optimizer steps (at least one: a fine-tune starts from a pretrained model).
      lr: learning rate.
      batch_size: examples per step.
    """

    data: DataConfig = dataclasses.field(default_factory=TextDataConfig)
    steps: Count = 20
    lr: Positive = 1e-3
    batch_size: Count = 16


@dataclasses.dataclass(frozen=True)
class FinetuneArmConfig(ArmConfig):
    """An arm of the fine-tune: an estimator, its learning rate and the engine that trains it.

    Attributes:
      engine: the engine section (``type: local`` in memory, ``type: stream`` from a layer
        store: ``store: null`` keeps it in the run directory, ``<run>/stores/<arm>``).
    """

    engine: EngineConfig = dataclasses.field(default_factory=LocalEngineConfig)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig(Checked):
    """A fine-tune experiment (see the module docstring).

    Attributes:
      seed: seeds the initial params, the batch order and the tangents.
      model: the model section.
      pretrain: the in-memory pretraining.
      data_store: the fine-tune's data store (read batch by batch during training); null:
        ``<run>/data``. Written from ``source`` when it holds no data store yet.
      source: the data written to ``data_store`` (null: the store must exist).
      steps: fine-tune steps per arm.
      batch_size: examples per fine-tune step.
      eval_every: log train/test loss every this many steps (and at the first and last).
      optimizer: the fine-tune's optimizer (an arm may name its own).
      arms: the fine-tunes to compare, each with its engine.
      progress: show progress bars (on a terminal).
    """

    seed: Seed = 0
    model: ModelConfig = dataclasses.field(default_factory=CharTransformerConfig)
    pretrain: PretrainConfig = dataclasses.field(default_factory=PretrainConfig)
    data_store: str | None = None
    source: DataConfig | None = dataclasses.field(
        default_factory=lambda: TextDataConfig(corpus="b"))
    steps: Count = 20
    batch_size: Count = 16
    eval_every: Count = 10
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    arms: tuple[FinetuneArmConfig, ...] = (FinetuneArmConfig(),)
    progress: bool = True

    def check(self) -> None:
        if self.data_store is not None and not self.data_store.strip():
            raise ValueError("data_store: a directory or null (<run>/data), got ''")
        if not self.arms:
            raise ValueError("arms: list at least one arm")
        for i, arm in enumerate(self.arms):
            if type(arm.engine) not in (LocalEngineConfig, StreamEngineConfig):
                raise ValueError(f"arms.{i}.engine: a fine-tune arm trains in memory (type: local) "
                                 f"or from a layer store (type: stream), got "
                                 f"{type(arm.engine).__name__}")
            try:
                self.train_config(i, "<data_store>")  # every arm's checks, as kind: train's
            except ValueError as e:
                raise ValueError(_arm_field(str(e), i)) from None
        names = [a.name for a in self.arms]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise ValueError(f"arms.{i}.name: {name!r} is used twice; names must be unique")
        check_optimizer(self.optimizer, "optimizer")

    def train_config(self, i: int, data_path: str | Path) -> TrainConfig:
        """Arm ``i`` as a one-arm ``kind: train`` config on the data store at ``data_path``
        (only a step-0 and a last evaluation beside ``eval_every``; no plots, no checkpoints
        between: a fine-tune arm is not resumed)."""
        arm = self.arms[i]
        plain = ArmConfig(name=arm.name, estimator=arm.estimator, lr=arm.lr,
                          optimizer=arm.optimizer)
        return TrainConfig(seed=self.seed, steps=self.steps, batch_size=self.batch_size,
                           eval_every=self.eval_every, diag_every=0, checkpoint_every=0,
                           model=self.model,
                           data=StoreDataConfig(path=str(data_path)),
                           optimizer=self.optimizer, engine=arm.engine, arms=(plain,),
                           plots=False, progress=self.progress)

    def check_run(self, resume: bool) -> None:
        """Before anything is written: the data store or its source, the batches against the
        data, the model against this machine's memory and disk, and no existing layer store."""
        if self.data_store is not None and not (Path(self.data_store) / INFO).is_file():
            where = Path(self.data_store)
            if where.exists() and (not where.is_dir() or any(where.iterdir())):
                raise ValueError(f"data_store: {where} exists but holds no data store ({INFO} "
                                 "is missing); point it at a data store or a new directory")
        if not self._store_exists() and self.source is None:
            raise ValueError(f"source: the data store {self.data_store or '<run>/data'} does not "
                             "exist, so a source data section to write it from is required "
                             "(e.g. source: {type: text, corpus: b})")
        self.pretrain.data.check_batch(self.pretrain.batch_size, self.seed,
                                       field="pretrain.batch_size", section="pretrain.data")
        if self._store_exists():
            info = json.loads((Path(self.data_store) / INFO).read_text())
            n = int(info.get("num_train", self.batch_size))
            if self.batch_size > n:
                raise ValueError(f"batch_size: {self.batch_size} exceeds the {n} training "
                                 f"examples of the data store {self.data_store}; allowed: 1..{n}")
        else:
            self.source.check_batch(self.batch_size, self.seed, section="source")
            info = self.source.dataset(self.seed).info
        pre = self.pretrain.data.dataset(self.seed).info
        for k in ("vocab_size", "seq_len", "num_classes", "in_dim"):
            if k in pre and k in info and pre[k] != info[k]:
                raise ValueError(f"pretrain.data: its {k} is {pre[k]}, the fine-tune data's is "
                                 f"{info[k]}; one model takes both: make them equal")
        check_memory(self.model, self.pretrain.batch_size)  # pretraining holds the whole model
        for i, arm in enumerate(self.arms):
            if arm.engine.streams_layers:
                check_disk(self.model, arm.engine.location(arm.name), field=f"arms.{i}.engine")
                try:
                    arm.engine.check_run([arm.name], resume)
                except ValueError as e:
                    raise ValueError(f"arms.{i}.{e}") from None

    def _store_exists(self) -> bool:
        return self.data_store is not None and (Path(self.data_store) / INFO).is_file()


def _arm_field(message: str, i: int) -> str:
    """A one-arm train config's error, named as the fine-tune's field of arm ``i``."""
    if message.startswith("arms.0"):
        return f"arms.{i}{message[len('arms.0'):]}"
    if message.startswith("engine"):
        return f"arms.{i}.{message}"
    return message
