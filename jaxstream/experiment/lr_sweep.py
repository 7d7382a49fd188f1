"""``kind: lr_sweep``: train each estimator at several learning rates side by side and pick one.

All learning rates of an arm train together as lanes (:mod:`jaxstream.experiment.lanes`): one
``vmap``-ed program whose optimizer (the config's section, schedule, warm-up and clipping
included) takes each lane's rate from its state. Batches, initial params and tangent keys are
those of ``kind: train`` with the same seed, so lane ``lr`` reproduces a train arm with that
``lr``.

The pick: the fewest steps to ``target_accuracy`` among learning rates whose mean test accuracy
over the last ``final_evals`` evaluations is at least ``stable_accuracy``; if none qualifies, the
best final accuracy.

Example (YAML):
    kind: lr_sweep
    steps: 1500
    lrs: [1.0e-4, 1.0e-3, 1.0e-2]
    arms:
      - {name: backprop, estimator: {type: backprop}}
      - {name: fwd_act_k4, estimator: {type: forward, perturb: activations, num_tangents: 4}}
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxstream.experiment.compiled import evaluator_for
from jaxstream.experiment.data_configs import DataConfig, DigitsDataConfig
from jaxstream.experiment.engines import LocalEngineConfig
from jaxstream.experiment.estimators import BackpropConfig, EstimatorConfig, describe
from jaxstream.experiment.lanes import Lane, Lanes
from jaxstream.experiment.model_configs import MLPConfig, ModelConfig
from jaxstream.experiment.optimizers import OptimizerConfig, check_optimizer
from jaxstream.experiment.progress import arm_bar
from jaxstream.experiment.registry import register_experiment
from jaxstream.experiment.rundir import MetricsLog
from jaxstream.ranges import Checked, Count, Positive, Probability, Seed


@dataclasses.dataclass(frozen=True)
class SweepArm(Checked):
    """An estimator whose learning rate is swept."""

    name: str = "backprop"
    estimator: EstimatorConfig = dataclasses.field(default_factory=BackpropConfig)


@dataclasses.dataclass(frozen=True)
class LRSweepConfig(Checked):
    """A learning-rate sweep: the ``optimizer`` section (name, options, clipping, warm-up,
    schedule) at each rate of ``lrs``."""

    seed: Seed = 0
    steps: Count = 1500
    batch_size: Count = 64
    eval_every: Count = 25
    target_accuracy: Probability = 0.95
    stable_accuracy: Probability = 0.96
    final_evals: Count = 4
    lrs: tuple[Positive, ...] = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
    model: ModelConfig = dataclasses.field(default_factory=MLPConfig)
    data: DataConfig = dataclasses.field(default_factory=DigitsDataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    arms: tuple[SweepArm, ...] = (SweepArm(),)
    progress: bool = True

    def check(self) -> None:
        if not self.lrs:
            raise ValueError("lrs: list one or more learning rates")
        if not self.arms:
            raise ValueError("arms: list at least one arm")
        if len(set(self.lrs)) != len(self.lrs):
            raise ValueError(f"lrs: each rate at most once, got {list(self.lrs)}")
        names = [a.name for a in self.arms]
        for i, arm in enumerate(self.arms):
            if names.index(arm.name) != i:  # results are kept by name: one would be lost
                raise ValueError(f"arms.{i}.name: {arm.name!r} is used twice; names must be "
                                 "unique")
            what, n = arm.estimator.batch_divisor()
            if self.batch_size % n:
                raise ValueError(f"arms.{i}.estimator.{what}: batch_size={self.batch_size}"
                                 f" is not divisible by {what}={n}")
        check_optimizer(self.optimizer)
        if self.optimizer.warmup_steps > self.steps:
            raise ValueError(f"optimizer.warmup_steps: the warm-up must end within steps = "
                             f"{self.steps}, got {self.optimizer.warmup_steps}")

    def check_run(self, resume: bool) -> None:
        """Before anything is written: the lanes fit in memory, the data set holds a batch."""
        from jaxstream.experiment.train_config import check_memory, max_tangents, tangents_field

        check_memory(self.model, self.batch_size, lanes=len(self.lrs),
                     tangents=max_tangents(a.estimator for a in self.arms),
                     named={"tangents": tangents_field(self.arms), "lanes": "lrs"})
        self.data.check_batch(self.batch_size, self.seed)


def pick_lr(results: dict[float, dict], stable: float) -> float:
    """The learning rate picked from ``{lr: {"steps_to_target", "final_accuracy"}}``."""
    ok = [lr for lr, r in results.items()
          if r["steps_to_target"] is not None and r["final_accuracy"] >= stable]
    if ok:
        return min(ok, key=lambda lr: (results[lr]["steps_to_target"],
                                       -results[lr]["final_accuracy"]))
    return max(results, key=lambda lr: results[lr]["final_accuracy"])


def _sweep_arm(cfg: LRSweepConfig, arm: SweepArm, stack: Any, data: Any, log: MetricsLog):
    """Every rate of ``cfg.lrs`` as a lane of ``kind: train`` with seed ``cfg.seed``
    (:mod:`.lanes`), evaluated on the test split every ``eval_every`` steps."""
    lanes = Lanes(stack, arm.estimator, cfg.optimizer, LocalEngineConfig(), train=data.train,
                  batch_size=cfg.batch_size, steps=cfg.steps, name=arm.name)
    veval = jax.jit(jax.vmap(evaluator_for(stack), in_axes=(0, None)))
    test = {k: np.asarray(v) for k, v in data.test.items()}
    hits: list[int | None] = [None] * len(cfg.lrs)
    bar = arm_bar(arm.name, start=0, total=cfg.steps, enabled=cfg.progress, leave=False)

    def on_eval(step: int, figures: np.ndarray, loss: np.ndarray) -> None:
        for i, lr in enumerate(cfg.lrs):
            test_loss, test_acc = (float(x) for x in figures[i])
            if hits[i] is None and test_acc >= cfg.target_accuracy:
                hits[i] = step
            log.append({"arm": arm.name, "lr": lr, "step": step, "loss": float(loss[i]),
                        "test_loss": test_loss, "test_accuracy": test_acc})
        bar.update(step - bar.n)

    out = lanes.run([Lane(lr, cfg.seed) for lr in cfg.lrs], cfg.eval_every,
                    lambda params: np.stack([np.asarray(v) for v in veval(params, test)], -1),
                    on_eval)
    bar.close()
    evals = out.curve[:, :, 1].T  # (evaluations, lrs): test accuracy
    n = min(cfg.final_evals, len(evals))  # a short run has fewer evaluations than asked for
    final = np.mean(evals[-n:], axis=0)
    best = np.max(evals, axis=0)
    return {lr: {"steps_to_target": hits[i], "final_accuracy": float(final[i]),
                 "best_accuracy": float(best[i]), "final_evals": n}
            for i, lr in enumerate(cfg.lrs)}


def format_sweep(summary: dict[str, Any], lrs: tuple[float, ...]) -> str:
    """A table: one row per arm, ``steps to target / final accuracy`` per learning rate."""
    head = f"{'arm':<18}" + "".join(f"{lr:>13.0e}" for lr in lrs) + f"{'picked':>9}"
    lines = [head, "-" * len(head)]
    for name, a in summary["arms"].items():
        cells = []
        for lr in lrs:
            r = a["results"][str(lr)]
            steps = "-" if r["steps_to_target"] is None else str(r["steps_to_target"])
            cells.append(f"{steps + ' / ' + format(r['final_accuracy'], '.3f'):>13}")
        lines.append(f"{name:<18}" + "".join(cells) + f"{a['picked_lr']:>9.0e}")
    lines.append(f"cells: steps to the target / final accuracy (the mean test accuracy of the "
                 f"last {summary.get('final_evals', 4)} evaluations)")
    return "\n".join(lines)


@register_experiment("lr_sweep", LRSweepConfig)
def run_lr_sweep(cfg: LRSweepConfig, run_dir: Path) -> dict[str, Any]:
    """Sweep every arm; write metrics.jsonl (one record per lr and evaluation); print a table."""
    data = cfg.data.dataset(cfg.seed)
    stack = cfg.model.build(data.info)
    log = MetricsLog(Path(run_dir) / "metrics.jsonl")
    log.rewrite([])
    arms = {}
    for arm in cfg.arms:
        results = _sweep_arm(cfg, arm, stack, data, log)
        arms[arm.name] = {"estimator": describe(arm.estimator),
                          "picked_lr": pick_lr(results, cfg.stable_accuracy),
                          "results": {str(lr): r for lr, r in results.items()}}
    used = {r["final_evals"] for a in arms.values() for r in a["results"].values()}
    summary = {"target_accuracy": cfg.target_accuracy, "stable_accuracy": cfg.stable_accuracy,
               "final_evals": min(used, default=cfg.final_evals),  # the evaluations averaged
               "arms": arms}
    print(format_sweep(summary, cfg.lrs))
    from jaxstream.experiment.plots import write_sweep_plots

    write_sweep_plots(summary, log.read(), Path(run_dir))
    return summary
