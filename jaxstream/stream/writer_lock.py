"""One writer per store: an OS lock (``fcntl.flock``) on ``writer.lock`` in the store.

The lock is held from a step's first write to its commit (or abort). A second process that
tries to write meanwhile gets :class:`StoreLockedError` naming the holder's pid; one that
writes later finds the manifest's generation moved on and gets ``StoreStaleError`` (see
:class:`~jaxstream.stream.store.LayerStore`). The kernel drops the lock when the holder dies,
so a killed writer never leaves a stale lock. Stores on non-``file`` kvstores have no lock.

Example::

    lock = WriterLock("/nvme/run")
    lock.acquire()      # raises StoreLockedError("... held by pid 1234 ...")
    lock.release()
"""

from __future__ import annotations

import os
from typing import Any

from jaxstream.pidlock import PidLock
from jaxstream.stream.errors import StoreLockedError, StoreWriteError
from jaxstream.stream.layout import kvstore_spec
from jaxstream.stream.manifest import MANIFEST

LOCK_FILE = "writer.lock"
# TensorStore's ``file`` kvstore writes a key through ``<key>.__lock`` (written, fsynced, renamed
# over the key). A writer killed before the rename leaves that file behind, and the next write
# of the key reuses it without truncating it (tensorstore 0.1.86): a shorter manifest then keeps
# the dead writer's tail and the store's commit record is damaged. Layer chunks have a fixed
# size, so only the manifest's is at risk.
STALE_MANIFEST = MANIFEST + ".__lock"


def local_dir(location: Any) -> str | None:
    """The local directory of a ``file`` kvstore location, else None."""
    spec = kvstore_spec(location)
    if isinstance(spec, dict) and spec.get("driver") == "file":
        return str(spec["path"])
    if isinstance(spec, str) and spec.startswith("file://"):
        return spec[len("file://"):]
    return None


class WriterLock:
    """An exclusive, non-blocking ``flock`` on ``<store>/writer.lock`` (no-op off ``file``):
    a :class:`~jaxstream.pidlock.PidLock` whose refusal is a :class:`StoreLockedError`."""

    def __init__(self, location: Any):
        self.dir = local_dir(location)
        self._lock = None if self.dir is None else PidLock(os.path.join(self.dir, LOCK_FILE))

    @property
    def held(self) -> bool:
        return self._lock is not None and self._lock.held

    def acquire(self) -> None:
        if self._lock is None or self._lock.held:
            return
        try:
            os.makedirs(self.dir, exist_ok=True)
            holder = self._lock.acquire()
        except OSError as err:
            raise StoreWriteError(f"cannot open the writer lock {self._lock.path}: {err}") from err
        if holder is not None:
            raise StoreLockedError(f"another writer is active on the store at {self.dir} "
                                   f"({holder} holds {self._lock.path}); one writer per store: "
                                   "stop that run, or point this one at another store")
        self._drop_stale_manifest()

    def _drop_stale_manifest(self) -> None:
        """Removes a manifest write a dead writer left unfinished: with this lock held no
        other process writes the store, and this one acquires it only with its own last
        commit landed, so no manifest write is in flight."""
        try:
            os.remove(os.path.join(self.dir, STALE_MANIFEST))
        except FileNotFoundError:
            pass
        except OSError as err:
            self.release()
            raise StoreWriteError(f"cannot remove {STALE_MANIFEST}, an unfinished manifest write "
                                  f"a killed writer left in {self.dir}: {err}") from err

    def holder(self) -> str | None:
        """``pid N on HOST`` of another process that holds the lock now, else None."""
        return None if self._lock is None else self._lock.holder()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown
            pass


def writer_of(manifest: dict) -> str:
    """Who committed ``manifest``: ``pid N on HOST, run R`` (what the manifest records)."""
    who = f"pid {manifest.get('writer_pid', 'unknown')}"
    if manifest.get("writer_host"):
        who += f" on {manifest['writer_host']}"
    run = manifest.get("extra", {}).get("run") if isinstance(manifest.get("extra"), dict) else None
    return f"{who}, run {run}" if run else who
