"""``kind: train``: train each arm of a :class:`TrainConfig` and log, checkpoint, summarise.

Every arm starts from the same initial params and sees the same batches (batch ``s`` is a pure
function of (seed, s)); the tangent key of step ``s`` is ``fold_in(key, s)``. So a run is a pure
function of its config, and a run resumed from a checkpoint at step k writes the same metrics as
an uninterrupted one (wall-clock fields ``*_time`` aside).

``train_time`` counts only the optimizer steps (compiled ahead of time, so compilation is
excluded; evaluation and diagnostics are excluded too).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxstream.data.batches import batch_at
from jaxstream.data.stored import batch_source
from jaxstream.experiment.checkpoints import ArmCheckpointer, identity
from jaxstream.experiment.compiled import diagnostics_for, engine_for, evaluator_for, model_for
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.engines import LocalEngineConfig, split_micro_batches
from jaxstream.experiment.estimators import describe, family
from jaxstream.experiment.loop import Resume, TrainLoop, resumed_records
from jaxstream.experiment.plots import plotted_target, write_plots
from jaxstream.experiment.progress import arm_bar, arm_done, bar_hook, status
from jaxstream.experiment.registry import register_experiment
from jaxstream.experiment.rundir import MetricsLog, read_run_id, writing
from jaxstream.experiment.summary import compare_families, format_table, summarize_arm
from jaxstream.experiment.train_config import ArmConfig, TrainConfig


def _eval_record(evaluate: Callable, params: Any, train: Mapping, test: Mapping
                 ) -> dict[str, float]:
    """Loss and accuracy on the whole splits (a split streamed from a store is read whole)."""
    test_loss, test_acc = jax.device_get(evaluate(params, {k: np.asarray(v) for k, v in
                                                           test.items()}))
    train_loss, train_acc = jax.device_get(evaluate(params, {k: np.asarray(v) for k, v in
                                                             train.items()}))
    return {"test_loss": float(test_loss), "test_accuracy": float(test_acc),
            "train_loss": float(train_loss), "train_accuracy": float(train_acc)}


def step_key(record: dict) -> str | None:
    """A train record's identity (one record per arm and step), for :meth:`MetricsLog.read`
    to skip a repeated one; None for a rollback mark, which shares its step's number."""
    if record.get("rollback") or "arm" not in record or "step" not in record:
        return None
    return f"arm {record['arm']} step {record['step']}"


def _diverged(record: dict) -> bool:
    """A non-finite loss, or a commit that failed a layer store's divergence guard."""
    return not math.isfinite(record.get("loss", 0.0)) or bool(record.get("guard_failed"))


def _warm_up(engine: Any, state: Any, batch: dict, key: jax.Array) -> float:
    """Compile the step before the clock starts; returns the seconds taken.

    A jitted step is called once (result discarded); an engine whose step writes host state
    (a layer store) compiles through its ``warm_up``, which writes nothing. Engines with
    neither are not called (their compilation stays in the first step).
    """
    warm = getattr(engine, "warm_up", None)  # optional (see the Engine protocol)
    if warm is None and not hasattr(engine.step, "lower"):
        return 0.0
    t0 = time.perf_counter()
    if warm is not None:
        warm(state, batch, key)
    else:
        jax.block_until_ready(engine.step(state, batch, key))
    return time.perf_counter() - t0


def train_arm(cfg: TrainConfig, arm: ArmConfig, *, stack: Any, data: Any, init_params: Any,
              run_dir: Path, log: MetricsLog, kept: list[dict], resume: bool,
              on_start: Callable[[list[dict]], None], rollback: bool = False,
              hooks: tuple[tuple[Callable[[Any], None], dict], ...] = ()) -> dict[str, Any]:
    """Train one arm from its last checkpoint (if resuming) to ``min(steps, max_steps)``;
    with ``rollback``, from its last sane state (a layer store's last sane commit, or the last
    checkpoint saved before the run diverged), even after a divergence.

    ``kept`` are the arm's records from an earlier session; those up to the restored step are
    kept and handed to ``on_start`` (which puts them in the log) before training goes on.
    ``hooks``: ``(fn, options)`` pairs added to the loop (``TrainLoop.add_hook(fn, **options)``)
    after the compilation, before the evaluation hook (an after-step hook runs before it).
    Returns the arm's records (kept + new) and run facts (compile time, divergence).
    """
    batches = batch_source(data.train, cfg.batch_size, cfg.seed)
    engine = engine_for(cfg, arm, stack, example_batch=batches(0))
    root = jax.random.key(cfg.seed)
    state = engine.init(init_params, jax.random.fold_in(root, 0))
    step_root = jax.random.fold_in(root, 1)
    opt = cfg.arm_optimizer(arm)
    ckpt = ArmCheckpointer(run_dir / "checkpoints" / arm.name, identity=identity(
        read_run_id(run_dir), arm.name, {"name": opt.name, "options": dict(opt.options)}))
    with ckpt:  # closed, its threads waited for, however the arm ends
        stop = min(cfg.steps, cfg.max_steps or cfg.steps)
        evaluate = evaluator_for(stack)
        diag = (diagnostics_for(engine, stack, local=arm.estimator.build().plan.local_target)
                if cfg.diag_every else None)
        tags = {"arm": arm.name}
        loop = TrainLoop(engine.step, tags=tags, batch_at=batches,
                         key_at=lambda s: jax.random.fold_in(step_root, s), stop_if=_diverged)
        resume_ckpt = _start_hooks(loop, engine, ckpt, run_dir, resume, rollback)
        state, start = loop.begin(state)
        if rollback:
            ckpt.drop_after(start)
        handed = start > 0 and not (resume or rollback)  # a new run on another run's store
        if handed:
            _check_handed(cfg, start, stop)
        records = [] if handed else resumed_records(kept, start, tags)
        if start == 0 or handed:  # where this run starts: evaluated, a hand-over said so
            records = [{**tags, "step": start, **({"handed_over": True} if handed else {}),
                        **_eval_record(evaluate, engine.params(state), data.train, data.test)}]
        if rollback:  # the lr may have changed: the log says from which step this one applies
            records.append({**tags, "step": start, "rollback": True, "lr": arm.lr})
        on_start(records)
        diverged = resume_ckpt.diverged and not rollback
        if diverged or start >= stop:
            return {"records": records, "compile_time": None, "diverged": diverged}

        status(f"{arm.name}: compiling the first step")
        compile_time = _warm_up(engine, state, loop.batch_at(start), jax.random.fold_in(step_root, 0))
        if diag is not None:
            loop.add_hook(lambda i: i.record.update(diag(i.state, i.batch, i.key)),
                          every=cfg.diag_every, before=True)
        for fn, options in hooks:
            loop.add_hook(fn, **options)
        loop.add_hook(lambda i: i.record.update(
            _eval_record(evaluate, engine.params(i.state), data.train, data.test)),
            every=cfg.eval_every, at=(cfg.steps,))
        bar = arm_bar(arm.name, start=start, total=stop, enabled=cfg.progress)
        loop.add_hook(bar_hook(bar))
        loop.add_hook(lambda i: (records.append(i.record), log.append(i.record)))
        settle = _save_hook(loop, engine, ckpt, cfg.checkpoint_every)
        out = loop.run(state, start=start, stop=stop, train_time=resume_ckpt.train_time)
        if settle is not None:
            settle()  # the arm's last commit is on disk before the next arm or the summary
        bar.close()
        stopped = stop if stop < cfg.steps and not out.stopped else None
        arm_done(arm.name, next((r for r in reversed(records) if "test_accuracy" in r), None),
                 cfg.progress, stopped_at=stopped, steps=cfg.steps)
        return {"records": records, "compile_time": compile_time, "diverged": out.stopped}


def _check_handed(cfg: TrainConfig, start: int, stop: int) -> None:
    """A run handed a store at step ``start`` (engine.continue_store) trains past it."""
    if start >= stop:
        field = "max_steps" if stop < cfg.steps else "steps"
        raise ConfigError(f"{field}: {stop} is not past step {start}, where the layer store "
                          f"this run continues (engine.continue_store) already is: it would "
                          f"train nothing; set {field} above {start}")


def _start_hooks(loop: TrainLoop, engine: Any, ckpt: ArmCheckpointer, run_dir: Path,
                 resume: bool, rollback: bool) -> Resume:
    """The loop's start: the arm's checkpoint restored when resuming (its last sane one with
    ``rollback``), and an engine's parameters kept outside the checkpoint (a layer store)
    brought to the same step."""
    resume_ckpt = Resume(ckpt, sane=rollback)
    if resume:
        loop.add_start_hook(resume_ckpt)
    resume_at = getattr(engine, "resume_at", None)  # parameters kept outside the checkpoint
    if resume_at is not None:
        back = {"rollback": True} if rollback else {}
        loop.add_start_hook(lambda st, s: resume_at(st, s, run_dir=run_dir, resume=resume,
                                                    **back))
    return resume_ckpt


def _save_hook(loop: TrainLoop, engine: Any, ckpt: ArmCheckpointer,
               every: int) -> Callable[[], None] | None:
    """Checkpoints every ``every`` steps and at the end, never ahead of the store the engine
    commits on a thread (its ``settle``, returned; None for an engine without one)."""
    settle = getattr(engine, "settle", None)  # a store committing on a thread

    def save(i) -> None:
        if settle is not None:
            settle()  # the checkpoint is never ahead of the store it stands for
        ckpt.save(i.step, i.state, {"train_time": i.record["train_time"],
                                    "diverged": _diverged(i.record)})

    loop.add_hook(save, every=every, at_end=True)
    return settle


def _check_arms_trace(cfg: TrainConfig, model: Any, params: Any, batch: dict) -> None:
    """Every arm's estimator traced once on the model, abstractly (``jax.eval_shape``, no
    compute), before any arm trains: what an estimator refuses on this model (local losses on a
    model that is not a stack, a batch it cannot take) stops the run with one line naming the
    arm, instead of after the earlier arms have trained. The in-memory engines only: the others
    check their arms when the config loads."""
    if not isinstance(cfg.engine, LocalEngineConfig):
        return
    key = jax.random.key(0)
    for i, arm in enumerate(cfg.arms):
        est = arm.estimator.build()
        micro = split_micro_batches(batch, arm.estimator.micro_batches)
        try:
            jax.eval_shape(lambda p, b, k, est=est: est(model, p, b, k)[:2], params, micro, key)
        except (TypeError, ValueError) as e:
            if isinstance(e, jax.errors.ConcretizationTypeError):
                continue  # needs concrete values to check: the first real step checks it
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"arms.{i}.estimator ({arm.name}): {first}") from e


@register_experiment("train", TrainConfig)
def run_train(cfg: TrainConfig, run_dir: Path, resume: bool = False,
              rollback: bool = False) -> dict[str, Any]:
    """Train every arm; write metrics.jsonl, plots; print and return the summary.
    ``rollback``: resume every arm from its last sane state (see :func:`train_arm`)."""
    run_dir = Path(run_dir)
    status(f"loading data ({type(cfg.data).__name__})")
    data = cfg.data.dataset(cfg.seed)
    stack = model_for(cfg, data.info, data.train["x"][:2])
    init_params = stack.init(jax.random.fold_in(jax.random.key(cfg.seed), 0))
    _check_arms_trace(cfg, stack, init_params, batch_at(data.train, cfg.batch_size, cfg.seed, 0))
    log = MetricsLog(run_dir / "metrics.jsonl")
    old = log.read(key=step_key) if resume else []  # damaged or repeated lines: skipped
    names = [a.name for a in cfg.arms]

    results: dict[str, dict] = {}
    for i, arm in enumerate(cfg.arms):
        done = [r for a in names[:i] for r in results[a]["records"]]
        later = [r for r in old if r.get("arm") in names[i + 1:]]

        def on_start(records: list[dict], done=done, later=later) -> None:
            # Canonical order (arm by arm, step by step); nothing from other arms is dropped.
            log.rewrite(done + records + later)

        kept = [r for r in old if r.get("arm") == arm.name]
        results[arm.name] = train_arm(cfg, arm, stack=stack, data=data, init_params=init_params,
                                      run_dir=run_dir, log=log, kept=kept,
                                      resume=resume or rollback, on_start=on_start,
                                      rollback=rollback)
    # New records of an arm were appended after the later arms' old ones: restore the order.
    log.rewrite([r for a in names for r in results[a]["records"]])

    records = [r for a in cfg.arms for r in results[a.name]["records"]]
    arms, families = {}, {}
    for arm in cfg.arms:
        a = summarize_arm(results[arm.name]["records"], cfg.target_accuracy)
        a.update(estimator=describe(arm.estimator), family=family(arm.estimator), lr=arm.lr,
                 compile_time=results[arm.name]["compile_time"],
                 diverged=results[arm.name]["diverged"])
        arms[arm.name], families[arm.name] = a, a["family"]
    finished = all(a["steps"] >= cfg.steps or a["diverged"] for a in arms.values())
    target = plotted_target(cfg, data.train["y"])  # None: this metric has no target line
    summary = {"finished": finished, "target_accuracy": cfg.target_accuracy,
               "plotted_target": target, "arms": arms,
               "comparison": compare_families(arms, families)}
    if cfg.plots:
        with writing(run_dir, "the plots"):
            write_plots(records, [a.name for a in cfg.arms], run_dir, target)
    print(format_table(arms, cfg.target_accuracy))
    return summary
