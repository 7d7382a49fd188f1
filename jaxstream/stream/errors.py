"""Errors raised by the layer and data stores, each naming what went wrong and where.

Every error is a :class:`StoreError`; each subclass also derives from the built-in exception
a caller would expect (``FileNotFoundError``, ``ValueError``, ``OSError``, ...).
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store error."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No committed store (no manifest) at the given location."""


class StoreMismatchError(StoreError, ValueError):
    """The store holds another model: a config field, leaf shape or dtype differs."""


class StoreWriteError(StoreError, OSError):
    """A write failed (e.g. a full disk); the last committed step is left intact."""


class StoreReadError(StoreError, OSError):
    """A read failed for a reason other than corruption (e.g. an I/O error)."""


class StoreCorruptError(StoreError, ValueError):
    """Stored data is damaged: a chunk's checksum, a missing or truncated chunk, or an
    invalid manifest (the message names the file and the field, or the leaf and layer)."""


class StoreLockedError(StoreError, RuntimeError):
    """Another process holds the store's writer lock (the message names its pid)."""


class StoreStaleError(StoreError, RuntimeError):
    """The step this handle opened was overwritten by another writer: reopen the store."""


class StoreNonFiniteError(StoreError, FloatingPointError):
    """Non-finite values were refused: the store keeps its last (finite) committed step."""


class StoreNotCommittedError(StoreCorruptError):
    """A sound chunk holds other values than the manifest committed there: a file swapped,
    copied in or rolled back (or, for a reader that opened an older step, overwritten since)."""


def not_committed(what: str, file: str = "") -> StoreNotCommittedError:
    """The error for a sound chunk that holds other values than the manifest committed there."""
    return StoreNotCommittedError(
        f"{what}: the chunk holds other values than the manifest committed for it (a chunk file "
        f"swapped, copied in or rolled back{', ' + file if file else ''}); refusing to read it")


class StoreDivergedError(StoreError, ArithmeticError):
    """The last commit failed the divergence guard (:mod:`jaxstream.stream.guard`): no step is
    staged past it, so the last sane commit stays whole for :meth:`LayerStore.rollback_to_sane`."""


def write_failed(key: str, where: str, err: BaseException, step: int) -> StoreWriteError:
    """A staged write of ``key`` that failed: the store stays at its committed ``step``."""
    return StoreWriteError(f"writing {key} to the store at {where} failed ({err}); the store "
                           f"is unchanged at its last committed step {step}")
