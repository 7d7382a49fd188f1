"""The stream engine's checks of a run's store paths before anything is written, and what its
records say (bytes, an optimizer's description)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxstream.experiment.config import ConfigError
from jaxstream.stream.layout import kvstore_spec
from jaxstream.stream.manifest import MANIFEST


def check_store_paths(cfg: Any, names: list[str], resume: bool) -> None:
    """Before anything is written: a new run refuses an existing store (unless
    ``continue_store``); only local paths can be checked here."""
    if cfg.store is None:
        return
    for name in names:  # a file where the store's directory would be, or above it
        spec = kvstore_spec(cfg.location(name))
        if isinstance(spec, dict) and spec.get("driver") == "file":
            path = os.path.abspath(spec["path"])
            taken = next((p for p in [path, *map(str, Path(path).parents)]
                          if os.path.isfile(p)), None)
            if taken is not None:
                raise ConfigError(f"engine.store: {cfg.location(name)} (arm {name!r}) "
                                  f"{'is' if taken == path else 'lies under'} a file, "
                                  f"{taken}; a layer store is a directory")
    if resume or cfg.continue_store:
        return
    for name in names:
        where = cfg.location(name)
        spec = kvstore_spec(where)
        if isinstance(spec, dict) and spec.get("driver") == "file" and os.path.exists(
                os.path.join(spec["path"], MANIFEST)):
            raise ConfigError(
                f"engine.store: a layer store already exists at {where} (arm {name!r}); "
                "pass --resume to continue that run (a train run), set "
                "engine.continue_store=true to train "
                "on from it, or choose another path")


def data_bytes(m: dict) -> dict[str, float]:
    """A step's bytes for the run's records: ``bytes_read`` / ``bytes_written`` of the arrays
    (parameters, optimizer state, scratch, carried means) and of the parameters alone. The
    manifest's bytes (in the executor's metrics) are left out: they depend on the writing
    process (its pid in the manifest) and on a reopened store's checks, and a run's records are
    a function of its config (a resumed run logs what an uninterrupted one does)."""
    kinds = ("params", "opt", "scratch", "carry")
    return {"bytes_read": float(sum(m[f"bytes_read_{k}"] for k in kinds)),
            "bytes_written": float(sum(m[f"bytes_written_{k}"] for k in kinds)),
            "bytes_read_params": float(m["bytes_read_params"]),
            "bytes_written_params": float(m["bytes_written_params"])}


def describe_optimizer(opt: dict) -> str:
    """``adam`` or ``sgd (momentum=0.9)``."""
    options = ", ".join(f"{k}={v}" for k, v in sorted(opt.get("options", {}).items()))
    return f"{opt.get('name')}" + (f" ({options})" if options else "")
