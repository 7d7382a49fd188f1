"""The run directory: resolved config, environment, metrics log.

Layout::

    runs/<name>/
      config.yaml      the resolved config (every default filled in; reloadable)
      env.json         jaxstream / jax / flax / optax / orbax versions, devices, command line
      metrics.jsonl    one JSON record per line (see :class:`MetricsLog`)
      summary.json     what the experiment returned
      *.png            plots
      checkpoints/     orbax checkpoints (one sub-directory per arm)
      run.lock         held (``flock``) by the one process that runs or resumes here
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from jaxstream.pidlock import PidLock

#: Fields that hold wall-clock measurements; they differ between otherwise identical runs.
TIME_SUFFIX = "_time"
TIME_PREFIX = "wall_"


def is_time_field(name: str) -> bool:
    """True for wall-clock fields (``*_time`` or ``wall_*``), excluded from reproducibility checks."""
    return name.endswith(TIME_SUFFIX) or name.startswith(TIME_PREFIX)


def strip_time_fields(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without its wall-clock fields."""
    return {k: v for k, v in record.items() if not is_time_field(k)}


def new_run_dir(base: str | Path) -> Path:
    """``base`` if it is free (absent or empty), else ``base_2``, ``base_3``, ...: never overwrite."""
    base = Path(base)
    candidate, i = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        i += 1
        candidate = base.with_name(f"{base.name}_{i}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


def run_dir_number(base: Path, path: Path) -> int | None:
    """``path``'s place among ``base`` (1), ``base_2`` (2), ...; None for any other name."""
    if path.name == base.name:
        return 1
    suffix = path.name[len(base.name):]
    if path.name.startswith(base.name) and suffix[:1] == "_" and suffix[1:].isdigit():
        return int(suffix[1:])
    return None


def latest_run_dir(base: str | Path) -> Path | None:
    """The latest of ``base``, ``base_2``, ... (the highest suffix, as :func:`new_run_dir`
    numbers them) that holds a config.yaml (for ``--resume`` without ``--out``)."""
    base = Path(base)
    if not base.parent.is_dir():
        return None
    found = [p for p in base.parent.iterdir() if run_dir_number(base, p) is not None
             and (p / "config.yaml").exists()]
    if not found:
        return None
    return max(found, key=lambda p: run_dir_number(base, p) or 0)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Library versions, Python, platform and JAX devices."""
    import jax

    devices = jax.devices()
    return {
        "versions": {d: _version(d) for d in ("jaxstream", "jax", "jaxlib", "flax", "optax",
                                               "orbax-checkpoint", "numpy", "tensorstore")},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "backend": jax.default_backend(),
        "device_count": len(devices),
        "device": str(devices[0].device_kind) if devices else None,
        "argv": sys.argv,
    }


@contextlib.contextmanager
def writing(path: str | Path, what: str | None = None) -> Iterator[None]:
    """A failed write (a full disk, a read-only directory) re-raised as one ``OSError`` line
    naming the file and the way on: the run's checkpoints are intact, ``--resume`` continues.

    Example:
        >>> with writing(run_dir / "summary.json"):
        ...     write_json(run_dir / "summary.json", summary)
    """
    try:
        yield
    except OSError as err:
        if err.errno is None or getattr(err, "named", False):
            raise
        named = OSError(err.errno, f"{err.strerror or os.strerror(err.errno)}: writing "
                        f"{what or Path(path).name} ({path}) failed; the run's checkpoints are "
                        "intact: free space (or make it writable), then pass --resume")
        named.named = True  # type: ignore[attr-defined]
        raise named from err


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON (atomically: temp file + rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path):
        try:
            tmp.write_text(json.dumps(_clean(data), indent=2) + "\n")
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else (1e308 if x > 0 else -1e308)
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


class MetricsLog:
    """``metrics.jsonl``: one record per line, appended as training goes (a crash keeps them).

    Records are plain dicts such as ``{"arm": "forward", "step": 10, "loss": 0.3,
    "step_time": 0.001, "train_time": 0.5}``. :meth:`rewrite` replaces the file atomically.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.damaged: list[int] = []  # line numbers (1-based) the last read could not parse
        self.repeated: list[int] = []  # line numbers the last read skipped as repeats
        self.incomplete = False  # whether the last read dropped an unfinished last line
        self._backup = False  # whether the next rewrite keeps the file read beside it

    def read(self, key: Callable[[dict[str, Any]], str | None] | None = None
             ) -> list[dict[str, Any]]:
        """All records. An incomplete last line (a crash mid-write) is dropped quietly; a
        damaged line elsewhere is skipped with a warning naming it, and every valid record
        after it is kept (:attr:`damaged` lists those lines). With ``key`` (a record's
        identity, e.g. ``"arm bp step 3"``, or None for a record that has none), a record
        repeating an earlier one's key is skipped with a warning too, the first kept
        (:attr:`repeated` lists those lines)."""
        self.damaged, self.repeated, self.incomplete = [], [], False
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.split("\n")
        out, seen, again = [], set(), []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise json.JSONDecodeError("not a record", line, 0)
            except ValueError:
                if i == len(lines) and not text.endswith("\n"):
                    self.incomplete = True
                    continue  # the unfinished last line of a killed run
                self.damaged.append(i)
                continue
            k = key(rec) if key is not None else None
            if k is not None and k in seen:
                self.repeated.append(i)
                again.append(k)
                continue
            seen.add(k)
            out.append(rec)
        if self.damaged:
            warnings.warn(f"{self.path}: line(s) {self.damaged} are damaged and were skipped; "
                          f"the {len(out)} valid records are kept", stacklevel=2)
        self._backup = bool(self.damaged or self.repeated)
        if self.repeated:
            shown = ", ".join(dict.fromkeys(again[:5])) + (", ..." if len(again) > 5 else "")
            warnings.warn(f"{self.path}: line(s) {_spans(self.repeated)} repeat earlier records "
                          f"({shown}) and were skipped; the first of each is kept", stacklevel=2)
        return out

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        """Replaces the file atomically; a file with damaged or repeated lines is kept beside
        it first (``metrics.jsonl.damaged``, once: later rewrites do not replace it), so
        nothing is lost by the rewrite."""
        if self._backup and self.path.exists():
            shutil.copyfile(self.path, self.path.with_suffix(".jsonl.damaged"))
        self._backup = False
        self._rewrite(records)

    def append(self, record: dict[str, Any]) -> None:
        with writing(self.path, "the metrics log"), self.path.open("a") as f:
            f.write(json.dumps(_clean(record)) + "\n")

    def _rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        with writing(self.path, "the metrics log"):
            try:
                tmp.write_text("".join(json.dumps(_clean(r)) + "\n" for r in records))
                tmp.replace(self.path)
            finally:
                tmp.unlink(missing_ok=True)


def _spans(numbers: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)


def diverged_record(record: dict[str, Any]) -> bool:
    """A step whose loss was not finite (JSON keeps NaN as null, inf as 1e308) or whose commit
    failed a layer store's divergence guard."""
    if record.get("guard_failed"):
        return True
    loss = record.get("loss", 0.0)
    return loss is None or not math.isfinite(loss) or abs(loss) >= 1e308


def diverged_arms(run_dir: Path, records: Iterable[dict[str, Any]]) -> list[str]:
    """The arms a run directory shows diverged: by summary.json, or by a step in ``records``
    (its metrics; a run killed before its summary)."""
    names = {r.get("arm") for r in records if diverged_record(r)}
    summary = Path(run_dir) / "summary.json"
    with contextlib.suppress(OSError, ValueError):
        arms = json.loads(summary.read_text()).get("arms", {}) if summary.is_file() else {}
        names |= {a for a, s in arms.items() if isinstance(s, dict) and s.get("diverged")}
    return sorted(n for n in names if isinstance(n, str))


def checkpoint_steps(run_dir: Path) -> dict[str, int]:
    """Each arm's last checkpointed step, read from ``checkpoints/<arm>/<step>`` names."""
    steps: dict[str, int] = {}
    for d in (Path(run_dir) / "checkpoints").glob("*/*"):
        if d.is_dir() and d.name.isdigit():
            steps[d.parent.name] = max(steps.get(d.parent.name, 0), int(d.name))
    return steps


LOCK_FILE = "run.lock"


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """One process at a time in a run directory: an exclusive, non-blocking ``flock`` on
    ``run.lock`` for the whole run (the kernel drops it when the process dies, so a killed run
    leaves no stale lock). A second process gets a ``ConfigError`` naming the holder's pid."""
    from jaxstream.experiment.config import ConfigError

    lock = PidLock(Path(run_dir) / LOCK_FILE)
    holder = lock.acquire()
    if holder is not None:
        raise ConfigError(f"{run_dir} is in use by another process ({holder} holds "
                          f"{lock.path}); one run or --resume at a time")
    try:
        yield
    finally:
        lock.release()


def has_results(run_dir: Path) -> bool:
    """Whether a run directory holds anything a run computed (metrics, a checkpoint, a
    summary), as opposed to only its config, environment and lock."""
    d = Path(run_dir)
    metrics = d / "metrics.jsonl"
    steps = [s for s in (d / "checkpoints").glob("*/*") if s.name.isdigit()]
    return (metrics.is_file() and metrics.stat().st_size > 0) or bool(steps) \
        or (d / "summary.json").exists()


@contextlib.contextmanager
def undo_on_refusal(run_dir: Path, refusals: tuple[type[BaseException], ...], *, new: bool,
                    made: bool) -> Iterator[None]:
    """A run refused (one of ``refusals``) before it computed anything leaves the directory as
    it found it: a new run's directory emptied (removed if this run ``made`` it), a resumed
    run's ``config.yaml`` and ``env.json`` put back. Results are never removed."""
    d = Path(run_dir)
    saved = {n: (d / n).read_bytes() for n in ("config.yaml", "env.json") if (d / n).is_file()}
    try:
        yield
    except refusals:
        if new and not has_results(d):
            for child in d.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
            if made:
                d.rmdir()
        elif not new:
            for name, data in saved.items():
                (d / name).write_bytes(data)
        raise


def read_run_id(run_dir: str | Path | None) -> str | None:
    """The identity a run directory's ``env.json`` records (None without one); a damaged
    env.json is a ConfigError naming it (a new identity would disown the run's checkpoints)."""
    from jaxstream.experiment.config import ConfigError

    env = Path(run_dir) / "env.json" if run_dir is not None else None
    if env is None or not env.is_file():
        return None
    try:
        data = json.loads(env.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        data = e
    if not isinstance(data, dict):
        why = (f"not readable JSON ({data})" if isinstance(data, ValueError)
               else f"expected a JSON object, got {type(data).__name__}")
        raise ConfigError(f"{env}: {why}; it holds the run's identity (run_id) that its "
                          "checkpoints carry: restore it, or start a new run in another --out")
    return data.get("run_id")
