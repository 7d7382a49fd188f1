"""One process at a time: an exclusive, non-blocking ``flock`` on a file that names its holder.

The kernel drops the lock when the holder dies, so a killed process never leaves a stale lock;
the holder's ``pid N on HOST`` is written into the file so that the one refused can say who
holds it. A lock file shared by hard links with a copy of its directory (``cp -al``) is first
given a file of its own, so the copy and the original lock apart. Used by the layer store's
writer lock and the run directory's lock.

Example::

    lock = PidLock("/nvme/run/writer.lock")
    holder = lock.acquire()     # None: acquired; else "pid 1234 on host" of the holder
    lock.release()
"""

from __future__ import annotations

import fcntl
import os
import socket


class PidLock:
    """An exclusive ``flock`` on ``path``, taken without waiting."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> str | None:
        """Takes the lock: None, or (held by another process) its holder's ``pid N on HOST``.

        Raises:
          OSError: the lock file cannot be opened (a missing directory, permissions).
        """
        if self._fd is not None:
            return None
        _own(self.path)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                return holder
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the file was replaced (:func:`_own`) while it was opened: again
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}".encode(), 0)
        except OSError:  # a full disk: the lock itself holds; only the pid is missing
            pass
        self._fd = fd
        return None

    def holder(self) -> str | None:
        """``pid N on HOST`` of another process holding the lock now, else None (never takes
        it for longer than the look)."""
        if self._fd is not None:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd)
        finally:
            os.close(fd)  # closing drops a lock taken here
        return None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _read(fd: int) -> str:
    text = os.pread(fd, 128, 0).decode(errors="replace").strip()
    return f"pid {text}" if text else "pid unknown"


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st, here = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def _own(path: str) -> None:
    """Gives ``path`` a file of its own where it is a hard link shared with another directory
    (a copy made with ``cp -al``: a lock on the shared file would lock both copies). Under a
    lock on the directory, so two processes of one directory never both replace it; a file
    locked now is left as it is (its holder's refusal names it)."""
    try:
        if os.stat(path).st_nlink <= 1:
            return
        folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_nlink <= 1:
                return
            old = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: leave it
            tmp = f"{path}.{os.getpid()}.own"
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            os.replace(tmp, path)
        except OSError:
            pass
        finally:
            os.close(old)
    finally:
        os.close(folder)  # drops the directory's lock
