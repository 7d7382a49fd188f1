"""The run directory: resolved config, environment, metrics log.

Layout::

    runs/<name>/
      config.yaml      the resolved config (every default filled in; reloadable)
      env.json         jaxstream / jax / flax / optax / orbax versions, devices, command line
      metrics.jsonl    one JSON record per line (see :class:`MetricsLog`)
      summary.json     what the experiment returned
      *.png            plots
      checkpoints/     orbax checkpoints (one sub-directory per arm)
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

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


def latest_run_dir(base: str | Path) -> Path | None:
    """The most recent of ``base``, ``base_2``, ... that holds a config.yaml (for ``--resume``)."""
    base = Path(base)
    found = [p for p in base.parent.glob(f"{base.name}*") if (p / "config.yaml").exists()
             and (p == base or p.name[len(base.name):].lstrip("_").isdigit())]
    if not found:
        return None
    return max(found, key=lambda p: int(p.name[len(base.name):].lstrip("_") or 1))


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


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON (atomically: temp file + rename)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_clean(data), indent=2) + "\n")
    tmp.replace(path)


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

    def read(self) -> list[dict[str, Any]]:
        """All records. An incomplete last line (a crash mid-write) is dropped quietly; a
        damaged line elsewhere is skipped with a warning naming it, and every valid record
        after it is kept (:attr:`damaged` lists those lines)."""
        self.damaged = []
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.split("\n")
        out = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError("not a record")
                out.append(rec)
            except ValueError:
                if i == len(lines) and not text.endswith("\n"):
                    continue  # the unfinished last line of a killed run
                self.damaged.append(i)
        if self.damaged:
            warnings.warn(f"{self.path}: line(s) {self.damaged} are damaged and were skipped; "
                          f"the {len(out)} valid records are kept", stacklevel=2)
        return out

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        """Replaces the file atomically; a file with damaged lines is kept beside it first
        (``metrics.jsonl.damaged``), so nothing is lost by the rewrite."""
        if self.damaged and self.path.exists():
            shutil.copyfile(self.path, self.path.with_suffix(".jsonl.damaged"))
        self._rewrite(records)

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(_clean(record)) + "\n")

    def _rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(_clean(r)) + "\n" for r in records))
        tmp.replace(self.path)
