"""The ``kind: grad_quality`` experiment: how close are forward and hybrid estimates?

For an MLP on scikit-learn's digits, in two data settings — ``correlated`` (every micro-batch is
drawn from the same few classes, so micro-batch gradients are alike) and ``shuffled`` (drawn
from all classes) — it measures, over R seeds and per layer, the cosine to the exact batch
gradient, relative variance, bias and SNR of:

* the hybrid's two ingredients alone: ``forward`` (forward estimates on all N micro-batches)
  and ``exact subset`` (the mean exact gradient of the selected micro-batches);
* each hybrid correction (``replace``, ``control_variate``, ``guess``, ``weighted``);

against the number of tangents K and against the number of exact micro-batches, plus the
headline comparison at the configured (N, num_exact, K) and the single-tangent Gaussian cosine
against √(2/(πn)). Results go to the run directory as JSON, CSV, text tables and PNG plots.

Example:
  $ jaxstream run experiments/grad_quality_mlp.yaml num_seeds=8
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

import jax
import numpy as np

import jaxstream.grad as jg
from jaxstream.data import load_digits
from jaxstream.experiment.loop import TrainLoop
from jaxstream.experiment.model_configs import MLPConfig, ModelConfig
from jaxstream.experiment.progress import work_bar
from jaxstream.experiment.registry import register_experiment
from jaxstream.experiment.rundir import write_json
from jaxstream.quality.baselines import ExactSubset, MicrobatchForward
from jaxstream.quality.compare import compare
from jaxstream.quality.report import write_outputs
from jaxstream.quality.theory import gaussian_cosine_approx, gaussian_cosine_mean
from jaxstream.ranges import Checked, Count, Every, Positive, Range, Seed

Setting = Literal["correlated", "shuffled"]
FORWARD, SUBSET = "forward", "exact subset"


@dataclasses.dataclass(frozen=True)
class GradQualityConfig(Checked):
    """Configuration of the gradient-quality study (``kind: grad_quality``).

    Attributes:
      seed: seeds the data split, initial params, micro-batch draws and estimator keys.
      model: the model section (an MLP by default).
      pretrain_steps: backprop Adam steps before measuring (0: measure at initialisation,
        where micro-batch gradients share a large common part; after training they are
        mostly example-specific and the correlated/shuffled contrast fades).
      pretrain_lr: learning rate of those steps.
      micro_batches: N micro-batches per batch.
      microbatch_size: examples per micro-batch.
      num_exact: exact micro-batches for the headline and the K sweep.
      num_tangents: K for the headline and the exact-count sweep.
      distribution: tangent distribution of forward and hybrid estimates.
      tangent_counts: the K sweep.
      exact_counts: the sweep over the number of exact micro-batches (each in 1..N).
      corrections: hybrid corrections to compare.
      settings: data settings (``correlated``, ``shuffled``), each at most once; each draws
        its batches from its own generator keyed by (seed, setting name).
      correlated_classes: how many classes the correlated micro-batches are drawn from.
      num_batches: batches per setting (statistics averaged over them).
      num_seeds: R estimator keys per batch (>= 2).
      theory_seeds: keys for the single-tangent Gaussian cosine check (0: skip it).
    """

    seed: Seed = 0
    model: ModelConfig = dataclasses.field(default_factory=lambda: MLPConfig(width=32, depth=3))
    pretrain_steps: Every = 0
    pretrain_lr: Positive = 0.01
    micro_batches: Count = 16
    microbatch_size: Count = 16
    num_exact: Count = 2
    num_tangents: Count = 1
    distribution: Literal["rademacher", "gaussian"] = "rademacher"
    tangent_counts: tuple[Count, ...] = (1, 4, 16)
    exact_counts: tuple[Count, ...] = (1, 2, 4, 8, 16)
    corrections: tuple[str, ...] = ("replace", "control_variate", "guess", "weighted")
    settings: tuple[Setting, ...] = ("correlated", "shuffled")
    correlated_classes: Annotated[int, Range(1, 10)] = 2  # digits has 10 classes
    num_batches: Count = 1
    num_seeds: Annotated[int, Range(2)] = 32  # two keys give a variance
    theory_seeds: Every = 512  # 0: skip the check

    def check(self) -> None:
        from jaxstream.experiment.estimators import check_correction
        from jaxstream.grad import combine

        if not self.corrections:  # the study's verdict picks the best of them
            raise ValueError("corrections: list one or more of "
                             + ", ".join(repr(c) for c in combine.corrections()))
        if len(set(self.corrections)) < len(self.corrections):
            twice = next(c for c in self.corrections if self.corrections.count(c) > 1)
            raise ValueError(f"corrections: {twice!r} is listed twice; list each at most once")
        if self.theory_seeds == 1:
            raise ValueError("theory_seeds: 0 (skip the check) or at least 2 (its tolerance is "
                             "a standard error over the keys), got 1")
        for i, c in enumerate(self.corrections):
            try:
                check_correction(c)
            except ValueError as err:
                raise ValueError(f"corrections.{i}: {str(err).split(': ', 1)[1]}") from None
        n = self.micro_batches
        if self.num_exact > n:
            raise ValueError(f"num_exact: must be at most micro_batches = {n}, got "
                             f"{self.num_exact}")
        if not self.tangent_counts:
            raise ValueError("tangent_counts: list one or more tangent counts")
        if not self.exact_counts or max(self.exact_counts) > n:
            raise ValueError(f"exact_counts: each must be in 1..{n}, got {self.exact_counts}")
        if not self.settings:
            raise ValueError("settings: choose at least one of 'correlated', 'shuffled'")
        seen: set[str] = set()
        for s in self.settings:
            if s in seen:
                raise ValueError(f"settings: {s!r} is listed twice; list each of 'correlated', "
                                 f"'shuffled' at most once")
            seen.add(s)

    def check_run(self, resume: bool) -> None:
        """Before anything is written: a batch of the study fits in memory."""
        from jaxstream.experiment.train_config import check_memory

        check_memory(self.model, self.micro_batches * self.microbatch_size,
                     tangents=max(self.tangent_counts + (self.num_tangents,)),
                     named={"batch": "micro_batches × microbatch_size",
                            "tangents": "num_tangents, tangent_counts"})


def microbatches(
    data: dict[str, np.ndarray], cfg: GradQualityConfig, setting: str, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One batch ``{"x": (N, B, 64), "y": (N, B)}`` of the given data setting.

    ``correlated``: every micro-batch is drawn from the same ``correlated_classes`` classes;
    ``shuffled``: drawn from the whole training set. Without replacement where possible.
    """
    total = cfg.micro_batches * cfg.microbatch_size
    if setting == "correlated":
        classes = rng.choice(10, cfg.correlated_classes, replace=False)
        pool = np.flatnonzero(np.isin(data["y"], classes))
    else:
        pool = np.arange(len(data["y"]))
    idx = rng.choice(pool, total, replace=total > len(pool))
    shape = (cfg.micro_batches, cfg.microbatch_size)
    return {k: v[idx].reshape(shape + v.shape[1:]) for k, v in data.items()}


def setting_rng(seed: int, setting: str) -> np.random.Generator:
    """The generator of one setting's batches, keyed by ``(seed, setting name)`` alone.

    A setting's batches (and so its numbers) do not depend on which other settings are listed
    or in what order. The name enters through a stable digest (not Python's salted ``hash``),
    so the draws are the same in every process.
    """
    digest = int.from_bytes(hashlib.sha256(setting.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, 2, digest])  # 2: the batch stream (pretrain uses seed+1)


def pretrain(stack: Any, params: Any, data: dict[str, np.ndarray], cfg: GradQualityConfig) -> Any:
    """A few backprop Adam steps of the local engine (the training loop, no hooks), so
    gradients are measured at a realistic point."""
    from jaxstream.experiment.engines import LocalEngine, LocalEngineConfig
    from jaxstream.experiment.estimators import BackpropConfig
    from jaxstream.experiment.optimizers import OptimizerConfig, build_optimizer

    engine = LocalEngine(LocalEngineConfig(), stack=stack, estimator=BackpropConfig().build(),
                         optimizer=build_optimizer(OptimizerConfig(), cfg.pretrain_lr))
    rng = np.random.default_rng(cfg.seed + 1)
    idx = [rng.choice(len(data["y"]), 128, replace=False) for _ in range(cfg.pretrain_steps)]
    key = jax.random.key(cfg.seed)  # backprop draws nothing
    loop = TrainLoop(engine.step, batch_at=lambda t: {k: v[idx[t]] for k, v in data.items()},
                     key_at=lambda t: key, timed=False)
    state = engine.init(params, key)
    return engine.params(loop.run(state, start=0, stop=cfg.pretrain_steps).state)


def _hybrid(cfg: GradQualityConfig, correction: str, num_exact: int, num_tangents: int):
    return jg.hybrid(
        num_exact=num_exact,
        correction=correction,
        num_tangents=num_tangents,
        distribution=cfg.distribution,
    )


def estimator_specs(cfg: GradQualityConfig) -> dict[tuple[str, int, int], Any]:
    """Every distinct estimator of the study, keyed ``(name, num_tangents, num_exact)``."""
    fwd = lambda k: MicrobatchForward(jg.forward(k, cfg.distribution))
    specs: dict[tuple[str, int, int], Any] = {}
    for k in sorted({*cfg.tangent_counts, cfg.num_tangents}):
        specs[(FORWARD, k, 0)] = fwd(k)
        for c in cfg.corrections:
            specs[(c, k, cfg.num_exact)] = _hybrid(cfg, c, cfg.num_exact, k)
    for m in sorted({*cfg.exact_counts, cfg.num_exact}):
        specs[(SUBSET, 0, m)] = ExactSubset(num_exact=m)
        for c in cfg.corrections:
            specs[(c, cfg.num_tangents, m)] = _hybrid(cfg, c, m, cfg.num_tangents)
    return specs


def theory_check(stack: Any, params: Any, batch: dict, cfg: GradQualityConfig) -> dict[str, float]:
    """Mean cosine of a single Gaussian tangent (full batch) against √(2/(πn)).

    The tolerance is 4 standard errors of the mean over ``theory_seeds`` keys.
    """
    keys = jax.random.split(jax.random.key(cfg.seed + 7), cfg.theory_seeds)
    table = compare({"gaussian K=1": jg.forward(1, "gaussian")}, stack, params, batch, keys)
    row = table.row("gaussian K=1")
    n = sum(int(x.size) for x in jax.tree.leaves(params))
    se = row["cosine_std"] / np.sqrt(cfg.theory_seeds)
    approx = gaussian_cosine_approx(n)
    return {
        "num_parameters": n,
        "num_seeds": cfg.theory_seeds,
        "cosine_mean": row["cosine_mean"],
        "cosine_std": row["cosine_std"],
        "standard_error": float(se),
        "theory_sqrt_2_over_pi_n": approx,
        "theory_exact": gaussian_cosine_mean(n),
        "relative_deviation": (row["cosine_mean"] - approx) / approx,
        "within_4_standard_errors": bool(abs(row["cosine_mean"] - approx) <= 4 * se),
    }


@register_experiment("grad_quality", GradQualityConfig)
def run_grad_quality(cfg: GradQualityConfig, run_dir: Path) -> dict[str, Any]:
    """Run the study; write tables and plots into ``run_dir``; return the summary.

    Example:
      >>> summary = run_grad_quality(GradQualityConfig(num_seeds=4), Path("runs/gq"))
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ds = load_digits(seed=cfg.seed)
    stack = cfg.model.build(ds.info)
    params = stack.init(jax.random.key(cfg.seed))
    params = pretrain(stack, params, ds.train, cfg)
    specs = estimator_specs(cfg)
    batches = {}
    for s in cfg.settings:  # one generator per setting: its batches ignore the other settings
        rng = setting_rng(cfg.seed, s)
        batches[s] = [microbatches(ds.train, cfg, s, rng) for _ in range(cfg.num_batches)]
    keys = jax.random.split(jax.random.key(cfg.seed + 3), cfg.num_seeds)
    rows: list[dict[str, Any]] = []
    for (name, k, m), est in work_bar(specs.items(), "grad_quality"):
        for setting in cfg.settings:
            table = compare({name: est}, stack, params, batches[setting], keys, microbatched={name})
            for r in table.rows:
                rows.append({"setting": setting, "num_tangents": k, "num_exact": m, **r})
    summary: dict[str, Any] = {"num_parameters": sum(x.size for x in jax.tree.leaves(params))}
    if cfg.theory_seeds:
        # shuffled when listed, whatever the order of settings (the check needs only one batch)
        on = "shuffled" if "shuffled" in cfg.settings else cfg.settings[0]
        flat = jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), batches[on][0])
        summary["gaussian_single_tangent"] = {**theory_check(stack, params, flat, cfg),
                                              "setting": on}
    summary.update(write_outputs(rows, cfg, run_dir))
    write_json(run_dir / "quality_summary.json", summary)  # atomically
    return summary
