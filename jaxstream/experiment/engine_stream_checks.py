"""The stream engine's checks of a run's store paths before anything is written, of a store it
is handed (its optimizer, the directory that trained it), and what its records say (bytes, an
optimizer's description)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxstream.experiment.config import ConfigError
from jaxstream.stream.errors import StoreError
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


def check_optimizer(store: Any, location: str | None, mine: dict | None) -> None:
    """A store holds one optimizer's state (Adam's and AdaBelief's have the same shapes): one
    that another optimizer wrote is refused naming both. A store from before stores recorded
    it is taken as it is (it cannot be told apart)."""
    theirs = store.extra.get("optimizer")
    if theirs is None or mine is None or theirs == mine:
        return
    raise StoreError(
        f"engine.store: the layer store at {location} (step {store.step}) holds the state of "
        f"optimizer {describe_optimizer(theirs)}, this run's optimizer is "
        f"{describe_optimizer(mine)}; set the optimizer section to the store's, or start from a "
        "new store (another engine.store path)")


def check_copy(store: Any, location: str | None, run_id: str | None, run_dir: str | None,
               ckpt: int) -> None:
    """A store ahead of the checkpoint (step ``ckpt``) was trained on by this run's directory,
    not by a copy of it (the same run identity, another directory): a copy's steps are not in
    this run's log."""
    theirs = store.extra.get("run_dir")
    if theirs is None or theirs == run_dir or store.extra.get("run") != run_id:
        return
    raise StoreError(
        f"--resume: the layer store at {location} is at step {store.step}, past this run's "
        f"checkpoint at step {ckpt}, trained from another directory with this run's identity "
        f"({theirs}: a copy of this run, or this run before it was moved); its steps are not in "
        "this run's log. Resume that directory (or move this one back there), or start a new "
        "run with engine.continue_store=true to train on from the store")


def check_owner(store: Any, location: str | None, run_id: str | None,
                resume: bool) -> list | None:
    """A resumed run continues only a store it wrote last (else refused naming both runs); a
    new run on another run's store gets the store's hand-overs with its own appended (None:
    the store is this run's, or the run has no identity, or the store predates them)."""
    owner = store.extra.get("run")
    if run_id is None or owner == run_id or (resume and owner is None):
        return None  # not run by the runner, its own store, or one from before stores kept it
    if resume:
        raise StoreError(
            f"--resume: the layer store at {location} (step {store.step}) was last written by "
            f"another run ({owner}), not this one ({run_id}): its steps are not this run's. "
            "Point engine.store at this run's store, or start a new run with "
            "engine.continue_store=true to train on from it deliberately")
    return [*store.extra.get("handovers", []),
            {"from_run": owner, "to_run": run_id, "step": store.step}]


def damaged(err: StoreError, store: Any) -> StoreError:
    """A damaged chunk a step (or its warm-up) read: the error with the ways on beside it."""
    return type(err)(f"{err}; nothing of this step was committed (the store is at step "
                     f"{store.step}). To go on, restore the store from a copy and --resume; "
                     f"or, where the damaged chunk is one the last step wrote, return to the "
                     f"step before it (LayerStore.open(path).rollback()) and train on from it "
                     f"in a new run (engine.continue_store=true)")


def unreadable(err: StoreError) -> StoreError:
    """A store a resume cannot open (a damaged manifest): the error with the ways on."""
    return type(err)(f"{err}; to go on, restore the store (or its manifest.json) from a copy, "
                     "or start a new run with another engine.store")


def identity(run_id: str | None, run_dir: str | None, optimizer_id: Any, rate: Any) -> dict:
    """What every commit of a run records: the run (its identity and directory), the
    optimizer whose state the store holds and its rate."""
    out: dict = {"run": run_id} if run_id else {}
    if run_dir:
        out["run_dir"] = run_dir
    if optimizer_id is not None:
        out["optimizer"] = optimizer_id
    if rate is not None:
        out["rate"] = rate
    return out
