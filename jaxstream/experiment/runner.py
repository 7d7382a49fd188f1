"""Run an experiment file: parse and check the config, make the run directory, dispatch on kind.

Example:
    >>> run_dir, summary = run_experiment("experiments/quickstart.yaml", ["steps=50"])
"""

from __future__ import annotations

import inspect
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from jaxstream.experiment.config import ConfigError, diff_configs, dump_yaml
from jaxstream.experiment.data_configs import forget_datasets
from jaxstream.experiment.registry import get_experiment, load_experiment
from jaxstream.experiment.rundir import (
    MetricsLog,
    checkpoint_steps,
    diverged_arms,
    environment,
    has_results,
    latest_run_dir,
    new_run_dir,
    read_run_id,
    run_lock,
    undo_on_refusal,
    write_json,
    writing,
)

#: Fields that may change between a run and its ``--resume`` (they do not change any metric).
RESUMABLE_CHANGES = ("max_steps", "progress", "plots")


def check_parents(base: Path, what: str) -> None:
    """Refuse, naming it and the fix, a dangling link or a file on the way to ``base``.

    A ``runs`` left as a link to another machine's folder, or as a file, would otherwise fail
    deep inside ``mkdir`` with ``File exists``.
    """
    for path in reversed((base, *base.parents)):
        if path.is_symlink() and not path.exists():
            raise ConfigError(
                f"{what}: {path} is a symbolic link to {path.readlink()}, which does not exist; "
                f"remove the link (rm {path}) or create its target, or pass --out DIR")
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{what}: {path} is a file, not a directory; move it away or "
                              "pass --out DIR")


def resolve_run_dir(config_path: str | Path, out: str | Path | None, resume: bool,
                    resumable: bool = True) -> Path:
    """Where a run writes (created if new).

    Without ``out``: ``runs/<config stem>``, or ``runs/<stem>_2``, ... if taken (nothing is
    overwritten); with ``resume`` the latest of those. With ``out``: that directory, which must
    be empty or absent unless resuming.
    """
    base = Path(out) if out is not None else Path("runs") / Path(config_path).stem
    check_parents(base, "--out" if out is not None else "the default run directory")
    if resume:
        found = latest_run_dir(base) if out is None else (
            base if (base / "config.yaml").exists() else None)
        if found is None:
            raise ConfigError(f"--resume: no run directory with a config.yaml at {base}")
        return found
    if base.exists() and not base.is_dir():
        raise ConfigError(f"--out: {base} is a file, not a directory")
    if out is not None:
        if base.exists() and any(base.iterdir()):
            how = ("pass --resume to continue that run or choose another directory"
                   if resumable else "this kind of run cannot be resumed: choose another "
                   "directory, or remove that one")
            raise ConfigError(f"--out: {base} already holds files; {how}")
        return _made(base, "--out", lambda: base.mkdir(parents=True, exist_ok=True) or base)
    return _made(base, "the default run directory", lambda: new_run_dir(base))


def _made(base: Path, who: str, make: Callable[[], Path]) -> Path:
    """``make()``; the machine's refusal (a read-only or missing path, a full disk) names
    ``who`` and the directory."""
    try:
        return make()
    except OSError as e:
        raise ConfigError(f"{who}: cannot create the run directory {base}: "
                          f"{e.strerror or e}") from e


def run_experiment(config_path: str | Path, overrides: Iterable[str] = (),
                   out: str | Path | None = None, resume: bool = False,
                   on_start: Callable[[Path], None] | None = None,
                   rollback: bool = False) -> tuple[Path, dict]:
    """Load ``config_path`` + overrides, check them, run, and write the run directory.

    Returns ``(run_dir, summary)``. Config errors (ValueError naming the field) are raised
    before anything is written or computed. ``on_start(run_dir)`` is called once the run
    directory holds its config, before the experiment runs (e.g. to follow its metrics live).
    ``rollback``: resume from the run's last sane state, also after a divergence (the arms'
    learning rates may change; see :func:`jaxstream.experiment.train.train_arm`).
    """
    if resume and rollback:
        raise ConfigError("--resume and --rollback: give one (--rollback continues a diverged "
                          "run, --resume any other)")
    forget_datasets()
    try:
        return _run(config_path, list(overrides), out, resume or rollback, on_start, rollback)
    finally:
        forget_datasets()


def _run(config_path: str | Path, overrides: list[str], out: str | Path | None, resume: bool,
         on_start: Callable[[Path], None] | None, rollback: bool = False) -> tuple[Path, dict]:
    kind, cfg = load_experiment(config_path, overrides)
    exp = get_experiment(kind)
    check_run = getattr(cfg, "check_run", None)  # memory, existing stores: before any write
    if check_run is not None:
        try:
            check_run(resume=resume)
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(str(err)) from err
    kwargs: dict[str, Any] = {}
    if "resume" in inspect.signature(exp.run).parameters:
        kwargs["resume"] = resume
    elif resume:
        raise ConfigError(f"--resume: experiments of kind {kind!r} cannot be resumed")
    if "rollback" in inspect.signature(exp.run).parameters:
        kwargs["rollback"] = rollback
    elif rollback:
        raise ConfigError(f"--rollback: experiments of kind {kind!r} cannot be rolled back")
    made = not (out is not None and Path(out).exists())
    run_dir = resolve_run_dir(config_path, out, resume,
                              resumable="resume" in inspect.signature(exp.run).parameters)
    with run_lock(run_dir), undo_on_refusal(run_dir, _refusals(), new=not resume, made=made):
        if resume:
            _check_resume(run_dir, kind, cfg, rollback)
        run_id = _run_id(run_dir, resume)  # a damaged env.json is refused before any write
        with writing(run_dir / "config.yaml"):
            (run_dir / "config.yaml").write_text(dump_yaml(cfg, {"kind": kind}))
        write_json(run_dir / "env.json", {**environment(), "config": str(config_path),
                                          "overrides": overrides, "resume": resume,
                                          "run_id": run_id})
        if on_start is not None:
            on_start(run_dir)
        summary = exp.run(cfg, run_dir, **kwargs)
        write_json(run_dir / "summary.json", summary)
    return run_dir, summary


def _run_id(run_dir: Path, resume: bool) -> str:
    """The run's identity: made when the run is new, kept by every ``--resume`` (a store or a
    checkpoint that another run has written is told apart by it)."""
    saved = read_run_id(run_dir) if resume else None
    if resume and not (run_dir / "env.json").exists() and has_results(run_dir):
        raise ConfigError(f"--resume: {run_dir / 'env.json'} is missing; "
                          "it holds the run's identity, which its checkpoints and layer stores "
                          "were written by: restore it, or start a new run in another --out")
    return saved or uuid.uuid4().hex


def _check_resume(run_dir: Path, kind: str, cfg: Any, rollback: bool = False) -> None:
    """A ``--resume`` continues the same experiment: same kind, same config but for
    ``RESUMABLE_CHANGES`` (and, with ``--rollback``, the arms' learning rates)."""
    flag = "--rollback" if rollback else "--resume"
    saved_kind, saved = load_experiment(run_dir / "config.yaml")
    if saved_kind != kind:
        raise ConfigError(f"{flag}: kind {kind!r} differs from {saved_kind!r} in "
                         f"{run_dir / 'config.yaml'}")
    log = MetricsLog(run_dir / "metrics.jsonl")
    with warnings.catch_warnings():  # damaged lines: the run's own read warns about them
        warnings.simplefilter("ignore")
        records = log.read()
    names = [a.name for a in getattr(saved, "arms", ())]
    if rollback:
        _check_diverged(run_dir, names, records)
    if kind == "train":
        _check_metrics(flag, log, records, checkpoint_steps(run_dir), names)
    allowed = list(RESUMABLE_CHANGES)
    if rollback:  # the diverged arms' rates; another arm's results stand at its own rate
        diverged = set(diverged_arms(run_dir, records))
        allowed += [f"arms.{i}.lr" for i, n in enumerate(names) if n in diverged]
    diff = diff_configs(saved, cfg, ignore=allowed)
    if diff:
        may = ", ".join(RESUMABLE_CHANGES) + (
            f", the lr of the arms that diverged ({', '.join(sorted(diverged))})"
            if rollback else "")
        raise ConfigError(f"{flag}: the config differs from {run_dir / 'config.yaml'} in "
                         f"{', '.join(diff)}; only {may} may change")


def _check_diverged(run_dir: Path, names: list[str], records: list[dict]) -> None:
    """``--rollback`` takes a diverged run back to its last sane state (where its lr may
    change); on a run that never diverged it would rewrite the lr behind its results."""
    if not diverged_arms(run_dir, records):
        raise ConfigError(f"--rollback: no arm of {run_dir} diverged (arms: "
                          f"{', '.join(names) or 'none'}); --rollback only continues a diverged "
                          "run: pass --resume to continue this one")


def _check_metrics(flag: str, log: MetricsLog, records: list[dict], steps: dict[str, int],
                   names: list[str]) -> None:
    """Every checkpointed step (from the arm's first record, 0 unless it continued another
    run's store, to its last checkpoint) must have its record: a resume keeps only those, so a
    missing or cut metrics.jsonl would give a wrong summary silently."""
    for arm in names:
        have = {r.get("step") for r in records if r.get("arm") == arm}
        first = min((k for k in have if isinstance(k, int)), default=0)
        lost = [k for k in range(first, steps.get(arm, 0) + 1) if k not in have]
        if steps.get(arm, 0) and lost:
            found = ("is missing" if not log.path.exists() else
                     "ends in an incomplete line" if log.incomplete else
                     f"has damaged line(s) {log.damaged}" if log.damaged else "lacks records")
            raise ConfigError(
                f"{flag}: {log.path} {found}, but checkpoints/{arm} reaches step {steps[arm]}: "
                f"arm {arm}'s records of {len(lost)} step(s) from step {lost[0]} would be lost "
                "and the summary wrong; restore the file, or start a new run in another --out")


def _refusals() -> tuple[type[BaseException], ...]:
    """The errors that refuse a run (a config, store or checkpoint it cannot honour; a value
    a library refuses while the run is built, a TypeError or ValueError): a run they stop
    before it computed anything leaves its directory as it found it."""
    from jaxstream.experiment.checkpoints import CheckpointError
    from jaxstream.stream.errors import StoreError

    return (ConfigError, StoreError, CheckpointError, TypeError, ValueError)
