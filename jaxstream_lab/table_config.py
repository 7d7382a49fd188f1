"""The forward table's config (``kind: forward_table``): data sets × arms, each arm an estimator
and its learning-rate sweep, checked when it loads (every refusal names its field)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Literal

from jaxstream.experiment.config import (
    ConfigError,
    apply_overrides,
    from_dict,
    read_yaml,
    registered_name,
)
from jaxstream.experiment.data_configs import DataConfig, DigitsDataConfig
from jaxstream.experiment.engines import EngineConfig, LocalEngineConfig
from jaxstream.experiment.estimators import BackpropConfig, EstimatorConfig
from jaxstream.experiment.model_configs import MLPConfig, ModelConfig
from jaxstream.experiment.optimizers import OptimizerConfig, check_optimizer
from jaxstream.ranges import Checked, Count, Fraction, Positive, Probability, Range, Seed

BASELINES = "baselines"  # the --arms name of the baseline rows (table_baselines)
BASELINE_NAMES = (BASELINES, "chance", "logistic regression", "unigram", "bigram")
ROW_KEYS = ("dataset", "arm", "test_error_mean", "test_error_sd", "train_error_mean", "seeds",
            "peak_temp_bytes", "cosine_mean")


@dataclasses.dataclass(frozen=True)
class TableArm(Checked):
    """An estimator and its learning-rate sweep (``lrs_by_dataset`` overrides per data set);
    ``local_heads``: train the data set's model with a head of its own per block
    (:func:`jaxstream.models.with_local_heads`; Ren et al.'s local losses), with
    ``local_groups`` groups of each block's output features, each with a head and a loss of
    its own (Ren et al.'s M/1/G; activity perturbation only), or with ``local_over:
    positions`` groups of its positions (a Mixer's tokens: patch-wise losses);
    ``local_patch_groups``: P groups of the positions besides the G of the features (P × G
    cells, Ren et al.'s LocalMixer losses); ``local_aggregate``: Ren et al.'s feature
    aggregator (one head per block on its whole output, each cell's loss through its own cell
    only) instead of a head per cell; ``datasets``: the data sets the
    arm runs on (empty: all; e.g. groups that divide one model's width); ``engine``: what
    runs its steps (the ``engine:`` section of ``kind: train``; its layer store, if any, is a
    scratch store per lane, so ``store`` stays null); ``optimizer``: overrides the table's;
    ``match_memory_of``: the name of another arm whose compiled step's temporary memory this
    arm (rematerialised backprop) matches by gradient accumulation: the fewest chunks of the
    batch whose step needs no more (:func:`jaxstream_lab.forward_table.matched_arm`)."""

    name: str = "backprop"
    estimator: EstimatorConfig = dataclasses.field(default_factory=BackpropConfig)
    lrs: tuple[Positive, ...] = (1e-3,)
    lrs_by_dataset: dict[str, tuple[Positive, ...]] = dataclasses.field(default_factory=dict)
    local_heads: bool = False
    local_groups: Count = 1
    local_over: Literal["features", "positions"] = "features"
    local_patch_groups: Count = 1
    local_aggregate: bool = False
    engine: EngineConfig = dataclasses.field(default_factory=LocalEngineConfig)
    optimizer: OptimizerConfig | None = None
    datasets: tuple[str, ...] = ()  # the data sets it runs on (empty: every one)
    match_memory_of: str | None = None  # an arm whose step memory this one matches

    def check(self) -> None:
        if self.match_memory_of is not None and not getattr(self.estimator, "remat", False):
            raise ValueError("match_memory_of: memory is matched by gradient accumulation of "
                             "rematerialised backprop; needs estimator {type: backprop, remat: "
                             "true}; allowed without it: null")
        for name, lrs in (("lrs", self.lrs), *((f"lrs_by_dataset.{k}", v)
                                             for k, v in self.lrs_by_dataset.items())):
            if not lrs:
                raise ValueError(f"{name}: list one or more learning rates")
        for name in ("local_groups", "local_patch_groups"):
            count = getattr(self, name)
            if count > 1 and not self.local_heads:
                raise ValueError(f"{name}: {count} groups need local heads of their own "
                                 "(local_heads: true); allowed without: 1")
            fp = self.estimator.build().plan.forward_pass
            if count > 1 and not (fp.local_losses and fp.tangents == "activations"):
                raise ValueError(f"{name}: grouped local losses need activity perturbation "
                                 "(estimator: {type: forward, perturb: activations, "
                                 "local_losses: true}): a weight tangent reaches every group; "
                                 "allowed: 1")
        if self.local_patch_groups > 1 and self.local_over == "positions":
            raise ValueError("local_patch_groups: local_over: positions already splits the "
                             "positions into local_groups; give the position groups as "
                             "local_patch_groups and the feature groups as local_groups "
                             "(local_over: features)")
        if self.local_aggregate and self.local_groups * self.local_patch_groups == 1:
            raise ValueError("local_aggregate: the feature aggregator needs cells "
                             "(local_groups or local_patch_groups > 1); allowed: false")
        if getattr(self.engine, "store", None) is not None:
            raise ValueError(f"engine.store: the table keeps each lane's layer store in a "
                             f"scratch directory of its own; leave it null, got "
                             f"{self.engine.store!r}")
        if self.optimizer is not None:
            check_optimizer(self.optimizer, "optimizer")
            self.engine.check_optimizer(self.optimizer, "optimizer")
        if self.local_heads and not self.estimator.build().plan.local_target:
            raise ValueError("local_heads: only local losses read local heads "
                             "(estimator: {type: forward, local_losses: true}, {type: "
                             "local_forward_weights} or {type: local_guess}); allowed: false")

    def runs_on(self, dataset: str) -> bool:
        """Whether the arm runs on ``dataset``."""
        return not self.datasets or dataset in self.datasets

    def sweep(self, dataset: str) -> tuple[float, ...]:
        return tuple(self.lrs_by_dataset.get(dataset, self.lrs))


@dataclasses.dataclass(frozen=True)
class TableDataset(Checked):
    """A data set, the model trained on it and the training length.

    ``validation``: the share of the training set held out (a permutation keyed by the table's
    seed) to pick each arm's learning rate on: the lowest mean final validation error (loss for
    ``metric: loss``), ties broken by the validation loss; the arms train on the rest. None:
    picked on the final train error, every training example trained on."""

    name: str = "digits"
    data: DataConfig = dataclasses.field(default_factory=DigitsDataConfig)
    model: ModelConfig = dataclasses.field(default_factory=MLPConfig)
    steps: Count = 500
    batch_size: Count = 64
    eval_every: Count = 50
    target_accuracy: Probability = 0.9
    train_eval_size: Count = 1000
    metric: Literal["error", "loss"] = "error"
    target_loss: Positive | None = None
    validation: Fraction | None = None

    def check(self) -> None:
        if self.metric == "loss" and self.target_loss is None:
            raise ValueError("target_loss: metric 'loss' needs a positive target test loss, "
                             "got null")
        if self.steps % self.eval_every:
            raise ValueError(f"steps: must be a multiple of eval_every ({self.eval_every}), got "
                             f"{self.steps}")


@dataclasses.dataclass(frozen=True)
class TableReport(Checked):
    """Which arm plays which part in the report: the report knows no arm by name, the table
    says here which is which (every name an arm of the table; a part none of whose arms ran
    on a data set is skipped there, saying so).

    ``reference``: exact backprop, read at each arm's compute (the equal-compute table);
    ``methods``: a published method (a key of ``published.json``'s figures) -> the arms that
    run it, preferred first: its published figures go beside them, and the published ordering
    is checked on the first of them that ran; ``forward``: the forward-gradient arms, the best
    of which is the hybrids' forward ingredient; ``exact_subset``: the hybrids' exact
    ingredient; ``hybrids``: the arms judged against both; ``shared_head``: an arm with the
    model's head shared by every block and the same design with heads of their own;
    ``base_design``: the local-loss design that ``designs`` are judged against; ``plot``: the
    arms the cost plot draws; ``about``: what the arms are, printed before the tables."""

    reference: str | None = None
    methods: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    forward: tuple[str, ...] = ()
    exact_subset: str | None = None
    hybrids: tuple[str, ...] = ()
    shared_head: tuple[str, str] | None = None
    base_design: str | None = None
    designs: tuple[str, ...] = ()
    plot: tuple[str, ...] = ()
    about: str = ""

    def named(self) -> list[tuple[str, str]]:
        """Every ``(dotted field, arm name)`` the section gives."""
        out = [(f, getattr(self, f)) for f in ("reference", "exact_subset", "base_design")
               if getattr(self, f) is not None]
        for f in ("forward", "hybrids", "shared_head", "designs", "plot"):
            out += [(f"{f}.{i}", a) for i, a in enumerate(getattr(self, f) or ())]
        for method, arms in self.methods.items():
            out += [(f"methods.{method}.{i}", a) for i, a in enumerate(arms)]
        return out

    def check_arms(self, names: list[str], published: tuple[str, ...]) -> None:
        """Refuse, by field, an arm that is not one of ``names`` or a method not ``published``."""
        for field, arm in self.named():
            if arm not in names:
                raise ValueError(f"report.{field}: {arm!r} is not an arm of the table; "
                                 f"allowed: {names} (a table whose arms are overridden gives "
                                 "its report section too: report={...}, or report={} for "
                                 "none)")
        for method in self.methods:
            if method not in published:
                raise ValueError(f"report.methods.{method}: not a published method; allowed: "
                                 f"{list(published)}")


@dataclasses.dataclass(frozen=True)
class ForwardTableConfig(Checked):
    """The whole table: data sets x arms, ``seeds`` seeds each; ``extend_sweeps``: rates a
    sweep may add past its edge (:func:`jaxstream_lab.forward_table.run_arm`); ``baselines``: add each data set's baseline
    rows (:mod:`.table_baselines`); ``optimizer``: every arm's (unless it brings its own; the
    rate is the arm's swept one); ``mid_probe_lr``: also measure each estimator against the
    exact gradient at mid-training (after half the steps of backprop with Adam at this rate;
    null: at initialisation only); ``report``: which arm plays which part in the report
    (:class:`TableReport`)."""

    seed: Seed = 0
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    seeds: Count = 3
    extend_sweeps: Annotated[int, Range(0, 8)] = 2  # rates added past a sweep's edge
    baselines: bool = True
    cosine_keys: Count = 8
    timing_steps: Count = 10
    mid_probe_lr: Positive | None = None  # Adam rate of the backprop run to mid-training
    datasets: tuple[TableDataset, ...] = (TableDataset(),)
    arms: tuple[TableArm, ...] = (TableArm(),)
    report: TableReport = TableReport()

    def _check_match(self, j: int, a: TableArm) -> None:
        """``arms.j.match_memory_of`` names another arm on the local engine that runs on every
        data set arm j runs on."""
        field, others = f"arms.{j}.match_memory_of", {b.name: b for b in self.arms if b is not a}
        target = others.get(a.match_memory_of)
        if target is None:
            raise ValueError(f"{field}: {a.match_memory_of!r} is not another arm of the table; "
                             f"allowed: {sorted(others)}")
        for arm in (a, target):
            if registered_name(arm.engine) != "local":
                raise ValueError(f"{field}: memory is measured on the local engine; arm "
                                 f"{arm.name!r} runs on {registered_name(arm.engine)!r}")
        missing = [d.name for d in self.datasets if a.runs_on(d.name)
                   and not target.runs_on(d.name)]
        if missing:
            raise ValueError(f"{field}: arm {target.name!r} does not run on {missing}, where "
                             f"arm {a.name!r} does")

    def check(self) -> None:
        for what, names in (("arms", [a.name for a in self.arms]),
                            ("datasets", [d.name for d in self.datasets])):
            if not names:
                raise ValueError(f"{what}: list at least one (the table has a row per arm "
                                 f"and a column per data set)")
            if len(set(names)) != len(names):
                raise ValueError(f"{what}: names must be distinct, got {names}")
        taken = {a.name for a in self.arms} & set(BASELINE_NAMES)
        if taken:
            raise ValueError(f"arms: {sorted(taken)} name(s) a baseline row; rename the arm "
                             f"(baseline names: {list(BASELINE_NAMES)})")
        check_optimizer(self.optimizer, "optimizer")
        from jaxstream_lab.table_rows import PUBLISHED_METHODS

        self.report.check_arms([a.name for a in self.arms], PUBLISHED_METHODS)
        names = [d.name for d in self.datasets]
        for j, a in enumerate(self.arms):
            for k, name in enumerate(a.datasets):
                if name not in names:
                    raise ValueError(f"arms.{j}.datasets.{k}: {name!r} is not a data set of "
                                     f"the table; allowed: {names}")
            for name in a.lrs_by_dataset:  # a misspelt one ran the arm at its lrs silently
                if name not in names:
                    raise ValueError(f"arms.{j}.lrs_by_dataset.{name}: not a data set of the "
                                     f"table; allowed: {names}")
            a.engine.check_arm(a, f"arms.{j}")  # the engine runs the arm's estimator
            if a.match_memory_of is not None:
                self._check_match(j, a)
            if a.optimizer is None:
                a.engine.check_optimizer(self.optimizer, "optimizer")
        for i, d in enumerate(self.datasets):
            for j, a in enumerate(self.arms):
                if not a.runs_on(d.name):
                    continue
                what, n = a.estimator.batch_divisor()
                field = f"arms.{j}.estimator"
                if n == 1 and a.engine.micro_batches > 1:  # the engine's N
                    what, n, field = "micro_batches", a.engine.micro_batches, f"arms.{j}.engine"
                if d.batch_size % n:
                    raise ValueError(f"{field}.{what}: {n} must divide "
                                     f"datasets.{i}.batch_size={d.batch_size}")
                try:
                    a.engine.check_model(d.model)
                except ValueError as e:
                    raise ValueError(f"arms.{j}.{e} (datasets.{i}.model)") from None
                warmup = self.arm_optimizer(a).warmup_steps
                if warmup > d.steps:
                    raise ValueError(f"arms.{j}.optimizer.warmup_steps: the warm-up must end "
                                     f"within datasets.{i}.steps = {d.steps}, got {warmup}")

    def arm_optimizer(self, arm: TableArm) -> OptimizerConfig:
        """The optimizer section that applies to ``arm``."""
        return arm.optimizer if arm.optimizer is not None else self.optimizer

    def check_run(self, resume: bool) -> None:
        """Before anything is written: each data set's lanes (rates × seeds) fit in memory and
        its data set holds a batch."""
        from jaxstream.experiment.train_config import check_memory, max_tangents, tangents_field

        tangents = max_tangents(a.estimator for a in self.arms)
        for i, d in enumerate(self.datasets):
            together = [a for a in self.arms if type(a.engine) is LocalEngineConfig
                        and a.runs_on(d.name)]
            lanes = self.seeds * max([len(a.sweep(d.name)) for a in together] or [1])
            check_memory(d.model, d.batch_size, lanes=lanes, tangents=tangents,
                         named={"tangents": tangents_field(self.arms),
                                "lanes": "seeds × the arms' learning rates"},
                         streamed=all(a.engine.streams_layers for a in self.arms),
                         field=f"datasets.{i}.model")
            d.data.check_batch(d.batch_size, self.seed, f"datasets.{i}.batch_size")


def load_table_config(path: str | Path, overrides: list[str] | None = None) -> ForwardTableConfig:
    """Parse a table YAML (``kind: forward_table``; unknown keys and bad values raise, naming
    the field)."""
    data = apply_overrides(read_yaml(path), overrides or [])
    kind = data.pop("kind", "forward_table")
    if kind != "forward_table":
        raise ConfigError(f"kind: expected 'forward_table', got {kind!r}")
    return from_dict(ForwardTableConfig, data)
