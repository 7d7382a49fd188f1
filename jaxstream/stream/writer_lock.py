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

import fcntl
import os
import socket
from typing import Any

from jaxstream.stream.errors import StoreLockedError, StoreWriteError
from jaxstream.stream.layout import kvstore_spec

LOCK_FILE = "writer.lock"


def local_dir(location: Any) -> str | None:
    """The local directory of a ``file`` kvstore location, else None."""
    spec = kvstore_spec(location)
    if isinstance(spec, dict) and spec.get("driver") == "file":
        return str(spec["path"])
    if isinstance(spec, str) and spec.startswith("file://"):
        return spec[len("file://"):]
    return None


class WriterLock:
    """An exclusive, non-blocking ``flock`` on ``<store>/writer.lock`` (no-op off ``file``)."""

    def __init__(self, location: Any):
        self.dir = local_dir(location)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self.dir is None or self._fd is not None:
            return
        path = os.path.join(self.dir, LOCK_FILE)
        try:
            os.makedirs(self.dir, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise StoreWriteError(f"cannot open the writer lock {path}: {err}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 128, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StoreLockedError(f"another writer is active on the store at {self.dir} (pid "
                                   f"{holder} holds {path}); one writer per store: stop that "
                                   "run, or point this one at another store") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError:  # full disk: the lock itself still holds; only the pid is missing
            pass
        self._fd = fd

    def holder(self) -> str | None:
        """``pid N on HOST`` of another process that holds the lock now, else None."""
        if self.dir is None or self._fd is not None:
            return None
        try:
            fd = os.open(os.path.join(self.dir, LOCK_FILE), os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 128, 0).decode(errors="replace").strip() or "unknown"
            return f"pid {text}"
        finally:
            os.close(fd)  # closing drops a lock taken here
        return None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

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
