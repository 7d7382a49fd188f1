"""Pieces of the layer store: read futures, leaf tables, config checks, the manifest write."""

from __future__ import annotations

import os
import sys
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
    StoreReadError,
    StoreWriteError,
)
from jaxstream.stream.layout import leaf_names
from jaxstream.stream.manifest import MANIFEST, encode


def read_error(err: BaseException, what: str) -> StoreError:
    """A TensorStore read failure as a store error naming ``what`` (leaf, layer, slot)."""
    if isinstance(err, StoreError):
        return err
    msg = str(err)
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
    that the slots read were not overwritten meanwhile).
    """

    def __init__(self, treedef: Any, futures: Sequence[Any], post: Callable | None = None,
                 names: Sequence[str] | None = None):
        self._treedef, self._futures, self._post = treedef, list(futures), post
        self._names = list(names) if names is not None else [f"leaf {i}" for i in range(len(futures))]

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> Any:
        leaves = []
        for f, name in zip(self._futures, self._names):
            try:
                leaves.append(np.asarray(f.result()))
            except Exception as err:  # every read failure becomes a StoreError
                raise read_error(err, name) from err
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


CRC_BYTES = 4  # the zarr3 crc32c codec appends the chunk's crc32c, little-endian
_DIRECT_CODECS = ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                  [{"name": "bytes"}, {"name": "crc32c"}])


class FileChunks:
    """Whole-chunk reads of a zarr3 array on a local ``file`` kvstore, bypassing TensorStore.

    Why: TensorStore verifies the crc32c codec with a portable (table-driven) crc32c on CPUs
    its abseil build does not recognise (about 3.5 GB/s here) and copies each chunk from its
    read buffer into the destination; reading the chunk file straight into an aligned array
    and verifying its crc32c with the ``crc32c`` package (SSE4.2 instruction, GIL released)
    costs about what a plain sequential read of the file costs. Only arrays whose chunks are
    raw little-endian bytes followed by a crc32c (the store's layout, :func:`array_spec`),
    with the default ``c/i/j/...`` chunk keys, get this path; :meth:`of` returns None for any
    other array (a ``memory://`` or remote kvstore, another codec chain), which keeps the
    TensorStore read. The checks are the same: a missing chunk, a chunk of the wrong size
    and a checksum mismatch are :class:`StoreCorruptError`.

    Example::

        direct = FileChunks.of(arr)            # arr: params/blocks/<leaf>, shape (L, 2, *leaf)
        layer = direct.read((l, slot), "leaf 0 of layer l").result()
    """

    def __init__(self, path: str, leaf_shape: tuple[int, ...], dtype: np.dtype):
        self._path, self._leaf_shape, self._dtype = path, leaf_shape, dtype
        self._tail = "/0" * len(leaf_shape)

    @classmethod
    def of(cls, arr: ts.TensorStore, lead: int) -> FileChunks | None:
        """The direct reader of ``arr`` whose chunks are one index of its ``lead`` leading
        axes (a whole leaf each), or None when the array is not laid out that way."""
        spec = arr.spec().to_json()
        kv, meta = spec.get("kvstore", {}), spec.get("metadata", {})
        chunk = meta.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape", [])
        keys = meta.get("chunk_key_encoding", {})
        dtype = np.dtype(arr.dtype.numpy_dtype)
        leaf = tuple(int(d) for d in arr.shape[lead:])
        if (sys.byteorder != "little" or kv.get("driver") != "file" or not kv.get("path")
                or meta.get("codecs") not in _DIRECT_CODECS or dtype.kind not in "biuf"
                or keys.get("name") != "default"
                or keys.get("configuration", {}).get("separator", "/") != "/"
                or list(chunk) != [1] * lead + list(leaf) or 0 in leaf):
            return None
        return cls(str(kv["path"]).rstrip("/") + "/c/", leaf, dtype)

    def read(self, index: tuple[int, ...], what: str) -> ChunkRead:
        """A read of the chunk at ``index`` (one per leading axis); ``what`` names it in errors."""
        file = self._path + "/".join(str(int(i)) for i in index) + self._tail
        return ChunkRead(file, self._leaf_shape, self._dtype, what)


class ChunkRead:
    """One chunk file read into a 64-byte aligned array and checked against its crc32c.

    The read runs when :meth:`result` is first called, on the caller's thread (a prefetch
    worker): ``os.preadv`` and ``crc32c`` both release the GIL.
    """

    def __init__(self, file: str, shape: tuple[int, ...], dtype: np.dtype, what: str):
        self._file, self._shape, self._dtype, self._what = file, shape, dtype, what
        self._out: np.ndarray | None = None

    def done(self) -> bool:
        return self._out is not None

    def result(self) -> np.ndarray:
        if self._out is None:
            self._out = self._read()
        return self._out

    def _read(self) -> np.ndarray:
        nbytes = int(np.prod(self._shape, dtype=np.int64)) * self._dtype.itemsize
        buf = aligned_empty((nbytes + CRC_BYTES,), np.uint8)
        try:
            fd = os.open(self._file, os.O_RDONLY)
        except FileNotFoundError as err:
            raise StoreCorruptError(f"{self._what}: the chunk is missing ({self._file})") from err
        try:
            size = os.fstat(fd).st_size
            got = 0
            while got < buf.nbytes:
                n = os.preadv(fd, [buf[got:]], got)
                if n == 0:
                    break
                got += n
        finally:
            os.close(fd)
        if size != buf.nbytes or got != buf.nbytes:
            raise StoreCorruptError(f"{self._what}: the chunk is truncated or malformed "
                                    f"({self._file} holds {size} bytes, expected {buf.nbytes})")
        stored = int.from_bytes(buf[nbytes:].tobytes(), "little")
        if crc32c.crc32c(buf[:nbytes]) != stored:
            raise StoreCorruptError(f"{self._what}: checksum mismatch, the chunk is damaged "
                                    f"({self._file})")
        return buf[:nbytes].view(self._dtype).reshape(self._shape)


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
