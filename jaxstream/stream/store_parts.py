"""Pieces of the layer store: read futures, leaf tables, config checks, the manifest write."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import crc32c
import jax
import numpy as np
import tensorstore as ts

from jaxstream.stream.errors import (
    StoreCorruptError,
    StoreError,
    StoreMismatchError,
    StoreNotCommittedError,
    StoreReadError,
    StoreWriteError,
    not_committed,
)
from jaxstream.stream.layout import leaf_names
from jaxstream.stream.manifest import MANIFEST, encode


def read_error(err: BaseException, what: str) -> StoreError:
    """A TensorStore read failure as a store error naming ``what`` (leaf, layer, slot)."""
    if isinstance(err, StoreError):
        return err
    msg = str(err)
    if "zarr.json" in msg and "Error opening" in msg:  # the array's metadata, not a chunk
        state = ("missing" if "NOT_FOUND" in msg or "does not exist" in msg
                 else "damaged (not the metadata tensorstore wrote)")
        return StoreCorruptError(f"{what}: the array's metadata file zarr.json is {state}; "
                                 f"restore the store from a copy ({msg})")
    if "NOT_FOUND" in msg or "is missing" in msg:
        return StoreCorruptError(f"{what}: the chunk is missing ({msg})")
    if "DATA_LOSS" in msg or "Digest mismatch" in msg:
        return StoreCorruptError(f"{what}: checksum mismatch, the chunk is damaged ({msg})")
    if "FAILED_PRECONDITION" in msg or "Not enough data" in msg or "INVALID_ARGUMENT" in msg:
        return StoreCorruptError(f"{what}: the chunk is truncated or malformed ({msg})")
    return StoreReadError(f"{what}: read failed ({msg})")


class TreeFuture:
    """A pending read of one pytree: ``result()`` waits for every leaf's TensorStore future.

    ``names`` (one per leaf) name the leaf in errors: a damaged or missing chunk raises
    :class:`StoreCorruptError` naming it; ``post`` runs on the finished tree (e.g. a check
    that the slots read were not overwritten meanwhile); ``count`` is told the bytes of the
    leaves read, once, when they first arrived (the store's byte counters).
    """

    def __init__(self, treedef: Any, futures: Sequence[Any], post: Callable | None = None,
                 names: Sequence[str] | None = None, count: Callable[[int], None] | None = None):
        self._treedef, self._futures, self._post = treedef, list(futures), post
        self._names = list(names) if names is not None else [f"leaf {i}" for i in range(len(futures))]
        self._count = count

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> Any:
        leaves = []
        for f, name in zip(self._futures, self._names):
            try:
                leaves.append(np.asarray(f.result()))
            except Exception as err:  # every read failure becomes a StoreError
                if isinstance(err, StoreNotCommittedError) and self._post:
                    self._post(None)  # a reader of an older step is told that first
                raise read_error(err, name) from err
        count, self._count = self._count, None
        if count is not None:
            count(sum(x.nbytes for x in leaves))
        tree = jax.tree_util.tree_unflatten(self._treedef, leaves)
        return self._post(tree) if self._post else tree


class WriteFuture:
    """A pending write whose failure surfaces as :class:`StoreWriteError` naming ``what``."""

    def __init__(self, future: Any, what: str):
        self._future, self._what = future, what

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> None:
        try:
            self._future.result()
        except Exception as err:  # every write failure becomes a StoreWriteError
            raise StoreWriteError(f"writing {self._what} failed ({err})") from err


ALIGN = 64  # bytes: XLA's CPU client aliases (does not copy) host buffers aligned to this


def aligned_empty(shape: Sequence[int], dtype: Any, align: int = ALIGN) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + nbytes].view(dtype).reshape(tuple(shape))


class ReadInto:
    """A TensorStore read into a 64-byte aligned NumPy array (``result()`` returns it).

    ``TensorStore.read()`` returns arrays aligned to 16 or 32 bytes; ``jax.device_put`` on
    the CPU backend then copies the whole layer once more. Reading into an aligned array
    costs the same and lets the CPU client alias it (no copy).
    """

    def __init__(self, view: ts.TensorStore):
        self.out = aligned_empty(view.shape, view.dtype.numpy_dtype)
        self._future = ts.array(self.out, copy=False, write=True).write(view)

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> np.ndarray:
        self._future.result()
        return self.out


class Verified:
    """A read whose values must have the crc32c ``expect`` (the manifest's record)."""

    def __init__(self, read: Any, expect: int, what: str):
        self._read, self._expect, self._what = read, expect, what

    def done(self) -> bool:
        return self._read.done()

    def result(self) -> np.ndarray:
        out = self._read.result()
        if digest(out) != self._expect:
            raise not_committed(self._what)
        return out


def digest(x: Any) -> int:
    """crc32c of an array's little-endian bytes: what the zarr3 crc32c codec stores after the
    chunk, so a chunk read directly is checked against it for free."""
    x = np.ascontiguousarray(x)
    return int(crc32c.crc32c(x.astype(x.dtype.newbyteorder("<"), copy=False).view(np.uint8)))


def leaf_table(tree: Any) -> list[dict]:
    leaves = jax.tree_util.tree_leaves(tree)
    return [
        {"name": n, "shape": list(np.shape(x)), "dtype": str(np.dtype(getattr(x, "dtype", np.float32)))}
        for n, x in zip(leaf_names(tree), leaves)
    ]


def master_dtype(x: Any) -> np.dtype:
    dt = np.dtype(getattr(x, "dtype", np.float32))
    return np.dtype(np.float32) if np.issubdtype(dt, np.floating) or dt.name == "bfloat16" else dt


def nested_from_names(names: list[str], leaves: list) -> Any:
    out: dict = {}
    for name, leaf in zip(names, leaves):
        d = out
        parts = name.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = leaf
    return out


def check_config(found: dict, expected: dict, where: str) -> None:
    for k in sorted(set(found) | set(expected)):
        if found.get(k) != expected.get(k):
            raise StoreMismatchError(
                f"store at {where} holds another model: model_config field {k!r} is "
                f"{found.get(k)!r} in the store but {expected.get(k)!r} was expected"
            )


def write_manifest(root: ts.KvStore, manifest: dict, where: str) -> None:
    """One atomic kvstore write (file driver: temp file, fsync, rename); the manifest is
    checksummed and non-finite values are refused (:class:`StoreNonFiniteError`)."""
    data = encode(manifest)
    try:
        root.write(MANIFEST, data).result()
    except Exception as err:
        raise StoreWriteError(f"writing {MANIFEST} to {where} failed ({err}); the store is unchanged "
                              "at its last committed step") from err
