"""``kind: forward_table``: Ren et al.'s forward-gradient table, reproduced on several data sets.

Rows: backprop (BP), rematerialised backprop (BP-remat), forward gradients with weight (FG-W)
or activity (FG-A) perturbation, the same with local losses (LG-FG-W, LG-FG-A), the exact
subset alone, and each hybrid correction. For each (data set, arm) every learning rate of the
arm's sweep and every seed is a lane (:mod:`jaxstream.experiment.lanes`): exactly the
``kind: train`` run of that arm with that ``lr`` and seed (seeds ``seed``, ``seed + 1``, ...;
the data set is loaded once, with ``seed``), on the arm's ``engine`` (``local`` by default:
every lane in one ``vmap``-ed program; ``pipeline``, ``stream``, ``dataparallel``,
``composed``: lane after lane through that engine's step) with the table's ``optimizer`` (Adam
by default; an arm may bring its own). The learning rate is picked by the lowest mean final *train*
error over seeds, ties broken by the train loss (the test set never chooses), or, for a data set
with ``validation: <share>``, by the same figures on that share of the training set, held out
(:func:`jaxstream_lab.table_data.table_data`; the arms train on the rest). Reported at that
rate: test and train error (mean ± sd over seeds), steps and seconds to the target test
accuracy, peak temporary memory of one compiled step (XLA's ``temp_size_in_bytes``; local engine
only), step time, and the cosine and relative squared error
‖ĝ − g‖² / ‖g‖² to the exact batch gradient at initialisation (mean over keys).

A data set with ``metric: loss`` (the character transformer on the text corpus) is judged by
its loss instead: the learning rate is picked by the lowest mean final train loss, the target
is a test loss (``target_loss``), and the report shows test and train loss (mean ± sd).

A pick at the edge of its sweep extends the sweep by one geometric step past that edge, up to
``extend_sweeps`` times; a pick still at an edge is flagged (``lr_at_edge``). Every rate keeps
its final figures per seed. Each data set also gets baseline rows (chance and logistic
regression; unigram and bigram tables for text: :mod:`.table_baselines`).

Batches are those of ``kind: train`` (epoch-wise shuffles of the train set, a pure function of
seed and step), the same for every arm and learning rate. The run directory gets ``rows.json``, ``results.md`` and
``frontier.png``, rewritten after every (data set, arm) row, so a killed run keeps its rows and
``jaxstream run ... --resume`` runs only the rows it lacks. Each row also counts its step's cost
in forward passes (``forward_equivalents_per_step``, from the compiled step's matmul FLOPs),
and ``cost.png`` plots test error against it.

The report knows no arm by name. The table's ``report:`` section
(:class:`jaxstream_lab.table_config.TableReport`) says which arm plays which part: the exact
reference, the arms that run Ren et al.'s published methods (their figures and claimed ordering
are data: ``published.json``), the hybrids and their ingredients, the local-loss designs. Every
name in it must be an arm of the table. It is recorded beside the rows (``--json``'s ``.meta``),
so a report written later from those rows reads the same section.

Example (YAML):
    kind: forward_table
    seeds: 3
    datasets: [{name: digits, data: {type: digits}, steps: 300}]
    arms:
      - {name: BP, estimator: {type: backprop}, lrs: [0.003]}
      - {name: FG-A, estimator: {type: forward, perturb: activations}, lrs: [0.001]}
      - {name: FG-A-pipe, estimator: {type: forward, perturb: activations}, lrs: [0.001],
         engine: {type: pipeline, stages: 2, micro_batches: 4}}
    report: {reference: BP, methods: {BP: [BP], FG-A: [FG-A, FG-A-pipe]}}
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxstream.data.batches import batch_at
from jaxstream.experiment.config import ConfigError, registered_name, to_dict
from jaxstream.experiment.docblock import machine
from jaxstream.experiment.lanes import Lane, Lanes, init_key
from jaxstream.experiment.registry import register_experiment
from jaxstream.experiment.rundir import write_json
from jaxstream.grad import local_targets
from jaxstream.models import to_stack, with_local_heads
from jaxstream_lab.budget_report import family
from jaxstream_lab.invocation import invocation
from jaxstream_lab.table_baselines import baselines
from jaxstream_lab.table_config import (
    BASELINES,
    ForwardTableConfig,
    TableArm,
    TableDataset,
)
from jaxstream_lab.table_data import lanes_evaluator, table_data
from jaxstream_lab.table_plots import equivalents_plot, frontier_plot
from jaxstream_lab.table_probe import agreement, backprop_params, forward_equivalents
from jaxstream_lab.table_report import markdown

ONE_RATE_STEP = 3.0  # the geometric step past a "sweep" of one rate


def extension(lrs: tuple[float, ...], side: str) -> float:
    """The next rate beyond a sweep's ``side`` ("largest" / "smallest"): one geometric step of
    the sweep (its mean ratio between neighbours; ×3 for a single rate) past the edge."""
    lo, hi = min(lrs), max(lrs)
    step = (hi / lo) ** (1.0 / (len(lrs) - 1)) if len(lrs) > 1 else ONE_RATE_STEP
    return float(f"{(hi * step if side == 'largest' else lo / step):.3g}")


def pick_lr(final: np.ndarray, metric: str, validation: bool = False) -> int:
    """Index of the picked rate in ``final`` (lr, seed, metric): lowest mean final train error,
    ties (e.g. all zero) broken by the mean final train loss (metric "loss": the other way
    round); with ``validation``, the same on the validation columns (4: error, 5: loss).
    Diverged lanes (NaN) sort last."""
    err, loss = (4, 5) if validation else (1, 3)
    by_err, by_loss = final[:, :, err].mean(axis=1), final[:, :, loss].mean(axis=1)
    keys = (by_err, by_loss) if metric == "loss" else (by_loss, by_err)
    return int(np.lexsort(keys)[0])


class _Arm:
    """One arm's training on one data set: its lanes (rates × seeds, :mod:`.lanes`) on the
    arm's engine, with the table's (or the arm's) optimizer."""

    def __init__(self, cfg: ForwardTableConfig, dcfg: TableDataset, arm: TableArm, ds: Any,
                 stack: Any, evaluate: Any = None):
        self.cfg, self.dcfg, self.arm = cfg, dcfg, arm
        if arm.engine.places_blocks:  # a sequential model runs as a stack
            staged = to_stack(stack, ds.train["x"][:2])
            stack, evaluate = staged, (evaluate if staged is stack else None)
        if arm.local_heads:
            stack = with_local_heads(stack, groups=arm.local_groups, x=ds.train["x"][:2],
                                     over=arm.local_over, patch_groups=arm.local_patch_groups,
                                     aggregate=arm.local_aggregate)
            evaluate = None  # its parameters carry the local heads
        self.stack = stack
        self.validation = ds.validation is not None
        self.evaluate = evaluate or lanes_evaluator(stack, ds, dcfg.train_eval_size)
        self.lanes = Lanes(stack, arm.estimator, cfg.arm_optimizer(arm), arm.engine,
                           train=ds.train, batch_size=dcfg.batch_size, steps=dcfg.steps,
                           model=dcfg.model, name=f"{dcfg.name}-{arm.name}")
        self.step_ms: dict[float, float] = {}  # lanes run one by one: median ms per rate

    def seeds(self) -> list[int]:
        """The lanes' seeds: those of ``kind: train`` runs with seed ``seed``, ``seed + 1``..."""
        return [self.cfg.seed + i for i in range(self.cfg.seeds)]

    def curve(self, rates: tuple[float, ...]) -> np.ndarray:
        """Train the lanes of ``rates`` × seeds; their curve (lr, seed, eval, metric)."""
        lanes = [Lane(lr, seed) for lr in rates for seed in self.seeds()]
        out = self.lanes.run(lanes, self.dcfg.eval_every, self.evaluate)
        if out.step_ms is not None:
            for i, lr in enumerate(rates):
                self.step_ms[lr] = float(np.median(out.step_ms[i * self.cfg.seeds:
                                                               (i + 1) * self.cfg.seeds]))
        return out.curve.reshape(len(rates), self.cfg.seeds, -1, out.curve.shape[-1])

    def sweep(self, rates: tuple[float, ...]) -> tuple[tuple, np.ndarray, list, int]:
        """``(rates tried, curve, rates added, pick)``: the sweep, extended past the edge its
        pick sits at, up to ``extend_sweeps`` times (a single rate: both neighbours)."""
        lrs = tuple(sorted(rates))
        curve = self.curve(lrs)
        pick, added = pick_lr(curve[:, :, -1], self.dcfg.metric, self.validation), []
        while len(added) < self.cfg.extend_sweeps and pick in (0, len(lrs) - 1):
            sides = ("smallest", "largest") if len(lrs) == 1 else (
                ("largest",) if pick == len(lrs) - 1 else ("smallest",))
            new = tuple(extension(lrs, side) for side in sides)
            more = self.curve(new)
            order = np.argsort(lrs + new)
            lrs = tuple(np.asarray(lrs + new)[order].tolist())
            curve = np.concatenate([curve, more])[order]
            added += list(new)
            pick = pick_lr(curve[:, :, -1], self.dcfg.metric, self.validation)
        return lrs, curve, added, pick

    def _cosines(self, estimate: Any, state: Any, batch: dict, exact_tree: Any,
                 params: Any) -> dict:
        """:func:`~jaxstream_lab.table_probe.agreement` of ``estimate`` over ``cosine_keys``
        keys at ``params`` on ``batch`` (to its local targets too, for an estimator that
        follows local losses)."""
        keys = jax.random.split(jax.random.fold_in(jax.random.key(self.cfg.seed), 11),
                                self.cfg.cosine_keys)
        local = self.arm.estimator.build().plan.local_target
        target = local_targets(self.stack, params, batch) if local else None
        return agreement(estimate, state, batch, exact_tree, target, keys)

    def _mid(self, engine: Any, state: Any, params0: Any) -> dict:
        """The agreement at mid-training (``mid_probe_lr``): at the parameters after half the
        steps of backprop with Adam from seed ``seed``'s start, on that step's batch; keys
        prefixed ``mid_`` (empty without ``mid_probe_lr``)."""
        if self.cfg.mid_probe_lr is None:
            return {}
        half, seed = self.dcfg.steps // 2, self.cfg.seed
        params = backprop_params(self.stack, params0, self.lanes.train, self.dcfg.batch_size,
                                 seed, half, self.cfg.mid_probe_lr)
        batch = batch_at(self.lanes.train, self.dcfg.batch_size, seed, half)
        exact = jax.jit(jax.grad(self.stack))(params, batch)
        out = self._cosines(engine.estimate, state._replace(params=params), batch, exact, params)
        return {"mid_step": half, **{f"mid_{k}": v for k, v in out.items()
                                     if not k.endswith("layers")}}

    def compiled_step(self, lr: float) -> tuple[Any, Any, Any, dict, jax.Array]:
        """``(compiled local step, engine, state, batch, key)`` of lane (``lr``, ``seed``) on its
        first batch."""
        lane = Lane(lr, self.cfg.seed)
        batch = batch_at(self.lanes.train, self.dcfg.batch_size, lane.seed, 0)
        engine = self.lanes.local_engine()
        state = self.lanes.init_state(engine, lane)
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), 11)
        return jax.jit(engine._step).lower(state, batch, key).compile(), engine, state, batch, key

    def probe(self, lr: float) -> dict:
        """One lane at rate ``lr`` (seed ``seed``'s start, its first batch): the agreement with
        the exact gradient over several keys (and at mid-training, ``mid_probe_lr``); on the
        local engine also the step compiled alone (temporary memory, its cost in forward
        passes, step time); on another engine the lanes' own median step time at ``lr``."""
        cfg, lane = self.cfg, Lane(lr, self.cfg.seed)
        batch = batch_at(self.lanes.train, self.dcfg.batch_size, lane.seed, 0)
        params0 = self.stack.init(init_key(lane.seed))
        exact = jax.jit(jax.grad(self.stack))(params0, batch)
        tangents = self.arm.estimator.build().plan
        out = {"tangents": tangents.spec.num if tangents.forward_pass.runs else 0}
        if self.step_ms:  # lanes ran one by one on their engine
            scratch = tempfile.mkdtemp(prefix="jaxstream-probe-")
            try:
                engine = self.lanes.build(lane, str(Path(scratch) / "store"))
                state = engine.init(params0, init_key(lane.seed))
                estimate = getattr(engine, "estimate", None)
                cos = ({} if estimate is None
                       else self._cosines(estimate, state, batch, exact, params0))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            return {**out, "peak_temp_bytes": None, "step_ms": self.step_ms[lr],
                    "flops_per_step": None, "forward_equivalents_per_step": None,
                    "cosine_mean": None, "cosine_sd": None, "relative_mse": None,
                    "bias_sq_rel": None, "variance_rel": None,
                    "cosine_layers": None, "local_cosine_layers": None, **cos}
        one, engine, state, batch, key = self.compiled_step(lr)
        flops, equivalents = forward_equivalents(one, self.stack, params0, batch)
        jax.block_until_ready(one(state, batch, key))
        times = []
        for k in jax.random.split(key, cfg.timing_steps):
            s0 = time.perf_counter()
            jax.block_until_ready(one(state, batch, k))
            times.append(time.perf_counter() - s0)
        return {**out, "peak_temp_bytes": int(one.memory_analysis().temp_size_in_bytes),
                "step_ms": float(np.median(times) * 1e3), "flops_per_step": flops,
                "forward_equivalents_per_step": equivalents,
                **self._cosines(engine.estimate, state, batch, exact, params0),
                **self._mid(engine, state, params0)}


def matched_arm(cfg: ForwardTableConfig, dcfg: TableDataset, arm: TableArm, ds: Any,
                stack: Any, evaluate: Any = None) -> tuple[TableArm, dict]:
    """``(arm, row fields)``: for an arm with ``match_memory_of``, the arm with the fewest
    accumulation chunks (a divisor of the batch size) whose compiled step's temporary memory is
    at most that of the named arm's step on this data set, measured by compiling both; where
    no number of chunks gets there, the one with the least memory, ``memory_matched: false``.
    Other arms come back as they are, with no fields."""
    if arm.match_memory_of is None:
        return arm, {}
    target_arm = next(a for a in cfg.arms if a.name == arm.match_memory_of)
    temp = lambda a: _Arm(cfg, dcfg, a, ds, stack, evaluate).compiled_step(
        a.sweep(dcfg.name)[0])[0].memory_analysis().temp_size_in_bytes
    target, temps = temp(target_arm), {}
    for chunks in (d for d in range(1, dcfg.batch_size + 1) if dcfg.batch_size % d == 0):
        est = dataclasses.replace(arm.estimator, accumulate=chunks)
        temps[chunks] = temp(dataclasses.replace(arm, estimator=est))
        if temps[chunks] <= target:
            break
    chunks = next((c for c, t in temps.items() if t <= target), min(temps, key=temps.get))
    fields = {"accumulate": chunks, "memory_target_arm": target_arm.name,
              "memory_target_bytes": int(target), "memory_matched": temps[chunks] <= target,
              "temp_bytes_by_accumulate": {str(c): int(t) for c, t in temps.items()}}
    return dataclasses.replace(arm, estimator=dataclasses.replace(
        arm.estimator, accumulate=chunks)), fields


def run_arm(cfg: ForwardTableConfig, dcfg: TableDataset, arm: TableArm, ds: Any, stack: Any,
            evaluate: Any = None) -> dict:
    """Train every (lr, seed) lane of one arm together; the row at the picked learning rate.

    A pick at either edge of its sweep extends the sweep by one geometric step past that edge
    (a single rate: both neighbours, ×3 and ÷3) and trains the new rates' lanes, up to
    ``cfg.extend_sweeps`` times; a pick still at an edge after that (a single rate never
    extended included) is flagged in the row (``lr_at_edge``)."""
    runner = _Arm(cfg, dcfg, arm, ds, stack, evaluate)
    t0 = time.perf_counter()
    lrs, curve, added, pick = runner.sweep(arm.sweep(dcfg.name))
    train_seconds = time.perf_counter() - t0
    final = curve[:, :, -1]
    by_err, by_loss = final[:, :, 1].mean(axis=1), final[:, :, 3].mean(axis=1)
    fin, cur = final[pick], curve[pick]
    if dcfg.metric == "loss":
        reached = cur[:, :, 2] <= dcfg.target_loss
    else:
        reached = cur[:, :, 0] <= 1.0 - dcfg.target_accuracy
    first = [int((np.argmax(r) + 1) * dcfg.eval_every) if r.any() else None for r in reached]
    probe = runner.probe(float(lrs[pick]))
    hit = [f for f in first if f is not None]
    sd = (lambda x: float(np.std(x, ddof=1))) if cfg.seeds > 1 else (lambda x: 0.0)
    return {
        "dataset": dcfg.name, "arm": arm.name, "lr": float(lrs[pick]), "lrs": list(lrs),
        "lrs_added": added, "lr_at_edge": pick in (0, len(lrs) - 1),
        "test_error_mean": float(fin[:, 0].mean()), "test_error_sd": sd(fin[:, 0]),
        "train_error_mean": float(fin[:, 1].mean()), "train_error_sd": sd(fin[:, 1]),
        "test_loss_mean": float(fin[:, 2].mean()), "test_loss_sd": sd(fin[:, 2]),
        "train_loss_mean": float(fin[:, 3].mean()), "train_loss_sd": sd(fin[:, 3]),
        "metric": dcfg.metric, "target_loss": dcfg.target_loss,
        "uniform_loss": float(np.log(ds.info["num_classes"])),  # the stability rule's bar
        "local_heads": "own" if arm.local_heads else "shared", "local_groups": arm.local_groups,
        "local_over": arm.local_over, "local_patch_groups": arm.local_patch_groups,
        "local_aggregate": arm.local_aggregate,
        "engine": registered_name(arm.engine), "model": registered_name(dcfg.model),
        "optimizer": cfg.arm_optimizer(arm).name, "estimator": arm.estimator.describe(),
        **dict(zip(("family", "directions"), family(arm.estimator))),
        "seeds": cfg.seeds, "steps": dcfg.steps, **probe,
        "target_accuracy": dcfg.target_accuracy, "seeds_reaching_target": len(hit),
        "steps_to_target_mean": float(np.mean(hit)) if hit else None,
        "steps_to_target_by_seed": first,
        "seconds_to_target": float(np.mean(hit)) * probe["step_ms"] / 1e3 if hit else None,
        "train_seconds_all_lanes": train_seconds,
        "test_error_by_seed": [float(x) for x in fin[:, 0]],
        "test_loss_by_seed": [float(x) for x in fin[:, 2]],
        "train_error_by_lr": [float(x) for x in by_err],
        "train_loss_by_lr": [float(x) for x in by_loss],
        # every rate's final figures per seed (lr, seed), as trained
        "test_error_by_lr_seed": final[:, :, 0].tolist(),
        "train_error_by_lr_seed": final[:, :, 1].tolist(),
        "test_loss_by_lr_seed": final[:, :, 2].tolist(),
        "train_loss_by_lr_seed": final[:, :, 3].tolist(),
        "picked_on": "validation" if runner.validation else "train",
        **({"validation_error_by_lr_seed": final[:, :, 4].tolist(),
            "validation_loss_by_lr_seed": final[:, :, 5].tolist()} if runner.validation else {}),
        "curve_test_error_mean": [float(x) for x in cur[:, :, 0].mean(axis=0)],
        "curve_test_loss_mean": [float(x) for x in cur[:, :, 2].mean(axis=0)],
        "eval_every": dcfg.eval_every,
    }


def _line(row: dict) -> str:
    """One row as a line of the run's output."""
    opt = lambda v, spec, unit="": "—" if v is None else f"{v:{spec}}{unit}"
    temp = row["peak_temp_bytes"]
    return (f"{row['dataset']:8s} {row['arm']:24s} lr={row['lr']:.0e} test err "
            f"{100 * row['test_error_mean']:6.2f} ± {100 * row['test_error_sd']:5.2f} % "
            f"train {100 * row['train_error_mean']:6.2f} %  test loss "
            f"{row['test_loss_mean']:.3f} ± {row['test_loss_sd']:.3f}  "
            f"cos {opt(row['cosine_mean'], '.3f')}  "
            f"temp {opt(None if temp is None else temp / 2**20, '7.2f', ' MiB')}  "
            f"{row['step_ms']:.2f} ms/step [{row['engine']}]")


def run_table(cfg: ForwardTableConfig, datasets: list[str] | None = None,
              arms: list[str] | None = None, done: list[dict] | None = None,
              on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """All rows of the table (optionally a subset of data sets / arms by name).

    ``done``: rows of an earlier session, kept and not run again (a row is a pure function of
    the config, its data set and its arm); ``on_row(rows)`` is called after each new row.
    """
    kept = {(r["dataset"], r["arm"]): r for r in done or []}
    rows = []
    with_baselines = cfg.baselines and (not arms or BASELINES in arms)
    for dcfg in cfg.datasets:
        if datasets and dcfg.name not in datasets:
            continue
        names = [a.name for a in cfg.arms if (not arms or a.name in arms)
                 and a.runs_on(dcfg.name)]
        base = [r for r in kept.values() if r["dataset"] == dcfg.name and r.get("kind") == "baseline"]
        if all((dcfg.name, a) in kept for a in names) and (base or not with_baselines):
            rows += (base if with_baselines else []) + [kept[(dcfg.name, a)] for a in names]
            continue
        ds = table_data(dcfg, cfg.seed)
        if with_baselines:
            rows += base or baselines(dcfg.name, ds, dcfg.metric)
        stack = dcfg.model.build(ds.info)
        evaluate = lanes_evaluator(stack, ds, dcfg.train_eval_size)
        for arm in cfg.arms:
            if (arms and arm.name not in arms) or not arm.runs_on(dcfg.name):
                continue
            if (dcfg.name, arm.name) in kept:
                rows.append(kept[(dcfg.name, arm.name)])
                continue
            t0 = time.perf_counter()
            ran, matched = matched_arm(cfg, dcfg, arm, ds, stack, evaluate)
            row = {**run_arm(cfg, dcfg, ran, ds, stack, evaluate), **matched}
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            print(_line(row), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


@register_experiment("forward_table", ForwardTableConfig)
def run_forward_table(cfg: ForwardTableConfig, run_dir: Path, command: str = "jaxstream run",
                      resume: bool = False) -> dict:
    """Run the table, writing ``rows.json``, ``results.md`` and ``frontier.png`` into
    ``run_dir`` after every row (a killed run keeps its rows); ``resume`` keeps the rows
    already written and runs the others."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    done = _written_rows(run_dir / "rows.json") if resume else []
    t0 = time.perf_counter()
    config, command = invocation(run_dir, command)

    def write(rows: list[dict]) -> None:
        payload = {"command": command, "config": config, "machine": machine(), "rows": rows,
                   "seconds": time.perf_counter() - t0, "report": to_dict(cfg.report)}
        write_json(run_dir / "rows.json", rows)
        frontier_plot(rows, str(run_dir / "frontier.png"))
        cost = (str(run_dir / "cost.png") if equivalents_plot(
            rows, str(run_dir / "cost.png"), cfg.report.plot) else None)
        (run_dir / "results.md").write_text(markdown(payload, str(run_dir / "frontier.png"),
                                                     cost_plot=cost))

    rows = run_table(cfg, done=done, on_row=write)
    write(rows)
    return {"rows": len(rows), "resumed_rows": len(done), "seconds": time.perf_counter() - t0}


def _written_rows(path: Path) -> list[dict]:
    """The rows an earlier session of this run wrote (none if it wrote none)."""
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"--resume: {path} is damaged ({e}); move it away to run every "
                          "row again") from None
    if not isinstance(rows, list) or not all(
            isinstance(r, dict) and {"dataset", "arm"} <= set(r) for r in rows):
        raise ConfigError(f"--resume: {path} does not hold table rows; move it away to run "
                          "every row again")
    return rows
