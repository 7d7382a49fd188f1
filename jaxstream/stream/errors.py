"""Errors raised by the layer and data stores, each naming what went wrong and where."""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store error."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """No committed store (no manifest) at the given location."""


class StoreMismatchError(StoreError, ValueError):
    """The store holds another model: a config field, leaf shape or dtype differs."""


class StoreWriteError(StoreError, OSError):
    """A write failed (e.g. a full disk); the last committed step is left intact."""
