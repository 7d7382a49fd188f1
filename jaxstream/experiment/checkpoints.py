"""Orbax checkpoints of one arm's engine state, with the step and a little JSON metadata.

Saving is synchronous: a checkpoint that exists is complete (orbax writes to a temporary
directory and renames it), so a run killed mid-save still resumes from the previous one.

Every checkpoint carries a checksum of each array (in its JSON metadata, saved in the same
atomic step), and a restore recomputes them: a damaged array file, or damaged metadata, is
refused with one line naming the checkpoint and the way back (:class:`CheckpointError`), never
restored as other numbers.

Every checkpoint also carries the identity of what wrote it (the run id, the arm, the optimizer
with its options: :func:`identity`), checked on restore: a checkpoint copied in from another run
is refused naming both sides, never trained on as this run's. A checkpoint from before
identities were recorded is restored with a warning (it cannot be told apart; refusing it would
strand every run begun before), and the next save records the identity.

Example:
    >>> ckpt = ArmCheckpointer(run_dir / "checkpoints" / "backprop",
    ...                        identity=identity("3f2a...", "backprop", {"name": "adam"}))
    >>> ckpt.save(100, state, {"train_time": 1.2})
    >>> step, state, meta = ckpt.restore_latest(state)
"""

from __future__ import annotations

import contextlib
import errno
import gc
import hashlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


class CheckpointError(Exception):
    """A checkpoint that cannot be restored as it was saved (damaged data or metadata)."""


def checksums(state: Any) -> dict[str, str | None]:
    """A digest of each array of ``state`` (dtype, shape and bytes; PRNG keys by their data),
    keyed by its tree path. An array spread over several processes is not digested here (None):
    no process holds all of it."""
    out: dict[str, str | None] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            out[jax.tree_util.keystr(path)] = None
            continue
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        a = np.ascontiguousarray(np.asarray(leaf))
        h = hashlib.blake2b(f"{a.dtype.str}{a.shape}".encode(), digest_size=16)
        h.update(a.tobytes())
        out[jax.tree_util.keystr(path)] = h.hexdigest()
    return out


def identity(run_id: str | None, arm: str, optimizer: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's state belongs to: the run, the arm and the optimizer (its name and
    options: the kind of state it keeps)."""
    return {"run_id": run_id, "arm": arm,
            "optimizer": {"name": optimizer.get("name"), "options": optimizer.get("options", {})}}


def describe_identity(ident: dict[str, Any]) -> str:
    """``run R, arm A, optimizer adam {b1: 0.8}`` for messages."""
    opt = ident.get("optimizer") or {}
    options = " " + ", ".join(f"{k}={v}" for k, v in sorted(opt.get("options", {}).items()))
    return (f"run {ident.get('run_id')}, arm {ident.get('arm')}, optimizer {opt.get('name')}"
            f"{options if opt.get('options') else ''}")


class ArmCheckpointer:
    """A small wrapper around ``orbax.checkpoint.CheckpointManager`` (host-side state).

    ``identity`` (:func:`identity`) is saved with every checkpoint and must match on restore.
    """

    def __init__(self, directory: str | Path, max_to_keep: int = 2,
                 identity: dict[str, Any] | None = None):
        self.directory = Path(directory).absolute()
        self.identity = identity
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """The last saved step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> None:
        """Save ``state`` (a pytree of arrays) and JSON ``meta`` as ``step``, with the arrays'
        checksums."""
        meta = dict(meta or {}, step=int(step), checksums=checksums(state))
        if self.identity is not None:
            meta["identity"] = self.identity
        try:
            with _held_logs() as held:
                self.manager.save(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            meta=ocp.args.JsonSave(meta)),
                    force=True,
                )
                self.manager.wait_until_finished()
        except Exception as e:
            code = write_errno(e)
            if code is None:  # not the machine's: a bug, with its traceback and orbax's logs
                held.release()
                raise
            with _held_logs():  # orbax's threads and TensorStore's callbacks still finishing
                with contextlib.suppress(Exception):  # report what the failed save raised:
                    self.manager.close()              # nothing more of it is printed
                gc.collect()  # its abandoned coroutines, finalised while their reports are held
            logging.getLogger("asyncio").addFilter(_drop_write_errors)  # and any found later
            last = [s for s in self.manager.all_steps() if s < step]
            intact = (f"the checkpoint at step {max(last)} is intact" if last
                      else "no earlier checkpoint was written")
            raise OSError(code, f"{os.strerror(code)}: saving {self._where(step)} failed "
                          f"({intact}); free space (or make it writable), then pass "
                          "--resume") from e
        held.release()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` into the structure, shapes and dtypes of ``like``.

        Raises:
          CheckpointError: the checkpoint's files cannot be read, or an array differs from the
            checksum saved with it.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self.manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                        meta=ocp.args.JsonRestore()),
            )
            meta = dict(out["meta"])
        except Exception as e:  # orbax, tensorstore and JSON errors of a damaged checkpoint
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise CheckpointError(f"{self._where(step)} cannot be read ({type(e).__name__}: "
                                  f"{first}); {self._way_back(step)}") from e
        saved = meta.pop("checksums", None)
        if saved is not None:  # checkpoints written before checksums existed carry none
            got = checksums(out["state"])
            bad = [k for k in sorted(set(saved) | set(got))
                   if saved.get(k) is not None and saved.get(k) != got.get(k)]
            if bad:
                more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                raise CheckpointError(f"{self._where(step)}: array {bad[0]}{more} differs from "
                                      f"the checksum saved with it (the file is damaged); "
                                      f"{self._way_back(step)}")
        self._check_identity(step, meta.pop("identity", None))
        return jax.tree.map(_placed_like, out["state"], like), meta

    def _check_identity(self, step: int, saved: dict[str, Any] | None) -> None:
        """Refuses a checkpoint another run, arm or optimizer wrote (naming both sides)."""
        if self.identity is None:
            return
        if saved is None:
            warnings.warn(f"{self._where(step)} records no run identity (written before "
                          "checkpoints recorded one): resumed as this run's; its next save "
                          "records it", stacklevel=3)
            return
        mine = self.identity
        differ = [k for k in ("run_id", "arm", "optimizer")
                  if mine.get(k) is not None and saved.get(k) is not None
                  and mine.get(k) != saved.get(k)]
        if differ:
            raise CheckpointError(
                f"{self._where(step)} was written by {describe_identity(saved)}, not by this "
                f"{describe_identity(mine)}: its state is not this run's ({', '.join(differ)} "
                f"differ). Put this run's own checkpoints back in {self.directory}, or resume "
                "the run that wrote it (its own --out)")

    def _where(self, step: int) -> str:
        return f"checkpoint {self.directory / str(step)}"

    def _way_back(self, step: int) -> str:
        earlier = [s for s in self.manager.all_steps() if s < step]
        if earlier:
            return (f"remove {self.directory / str(step)} to resume from step {max(earlier)}, "
                    "or start a new run")
        return "start the run again without --resume (or with another --out)"

    def restore_latest(self, like: Any, where: Any = None) -> tuple[int | None, Any, dict[str, Any]]:
        """``(step, state, meta)`` of the latest checkpoint (whose ``meta`` passes ``where``,
        when given), or ``(None, like, {})``."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            state, meta = self.restore(step, like)
            if where is None or where(meta):
                return step, state, meta
        return None, like, {}

    def drop_after(self, step: int) -> None:
        """Deletes the checkpoints past ``step`` (a branch abandoned by ``--rollback``)."""
        for s in self.manager.all_steps():
            if s > step:
                self.manager.delete(s)

    def __enter__(self) -> ArmCheckpointer:  # noqa: PYI034
        return self

    def __exit__(self, kind: object, err: BaseException | None, tb: object) -> None:
        if err is None:
            self.close()
            return
        with contextlib.suppress(Exception):  # already failing (e.g. a full disk): that error
            self.close()                      # is the one to report

    def close(self) -> None:
        """Closes the manager and waits for its threads (none may outlive the run: at
        interpreter exit they would print)."""
        self.manager.close()


#: TensorStore's status codes (orbax raises them as ValueError) of a write the machine refused.
_STATUS_ERRNO = {"RESOURCE_EXHAUSTED": errno.ENOSPC, "PERMISSION_DENIED": errno.EACCES}


def write_errno(err: BaseException) -> int | None:
    """The errno of a failed write (an OSError's own, or that of TensorStore's status code in
    orbax's ValueError, e.g. ENOSPC for ``RESOURCE_EXHAUSTED``); None for any other error."""
    for e in (err, err.__cause__, err.__context__):
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        if isinstance(e, ValueError):
            head = str(e).lstrip()
            for status, code in _STATUS_ERRNO.items():
                if head.startswith(status):
                    return code
    return None


class _HeldLogs(logging.Filter):
    """Holds what orbax's threads report during a save — ``absl`` records, uncaught errors in
    threads and callbacks (each reports the error the save then raises, or a callback into
    its closed event loop): :meth:`release` reports them after all; dropped otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.reports: list[tuple[Any, Any]] = []  # (original hook, its argument(s))

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def release(self) -> None:
        logger = logging.getLogger("absl")
        records, self.records = self.records, []
        for r in records:
            logger.handle(r)
        reports, self.reports = self.reports, []
        for hook, args in reports:
            hook(*args)


def _drop_write_errors(record: logging.LogRecord) -> bool:
    """Drops asyncio's "exception was never retrieved" for a failed write of a save that has
    already been reported as one line (its futures are collected later, even at exit)."""
    exc = record.exc_info[1] if record.exc_info else None
    return exc is None or write_errno(exc) is None


@contextlib.contextmanager
def _held_logs() -> Iterator[_HeldLogs]:
    logger, held = logging.getLogger("absl"), _HeldLogs()
    hooks = (sys.excepthook, sys.unraisablehook, threading.excepthook)
    logger.addFilter(held)
    sys.excepthook = lambda *a: held.reports.append((hooks[0], a))
    sys.unraisablehook = lambda a: held.reports.append((hooks[1], (a,)))
    threading.excepthook = lambda a: held.reports.append((hooks[2], (a,)))
    try:
        yield held
    finally:
        logger.removeFilter(held)
        sys.excepthook, sys.unraisablehook, threading.excepthook = hooks


def _placed_like(restored: Any, like: Any) -> Any:
    """``restored`` placed as ``like`` was. Orbax returns arrays committed to a device; where the
    state was uncommitted (a fresh run's), a committed copy is a different input sharding to the
    jitted step, which would then recompile instead of reusing the compiled step."""
    if (isinstance(like, jax.Array) and not like.committed and isinstance(restored, jax.Array)
            and not jnp.issubdtype(restored.dtype, jax.dtypes.prng_key)):
        return jnp.asarray(np.asarray(restored))
    return restored
