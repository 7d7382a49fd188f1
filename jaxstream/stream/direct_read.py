"""Direct reads of a local store's chunk files: aligned, reused buffers, hardware crc32c.

Why: TensorStore verifies the zarr3 crc32c codec with a table-driven crc32c on CPUs its
abseil build does not recognise (about 3.5 GB/s here, a quarter of a layer read's CPU time)
and copies each chunk from its own read buffer into the destination; fresh destination
arrays cost a page fault (and the kernel zeroing the page) per page touched. Reading the
chunk file straight into a reused 4096-byte aligned buffer and checking the crc32c with the
``crc32c`` package (SSE4.2 instruction, GIL released) costs about what a plain sequential
read of the file costs. A chunk the page cache holds (a layer written back a step ago) is
copied from it (``preadv`` with ``RWF_NOWAIT``, which never waits for the disk: a few µs a
chunk); one it does not hold is read with ``O_DIRECT`` where the file system allows it: the
bytes go from the disk into the buffer without a page-cache copy (on this machine's virtual
disk a 16 MiB chunk costs 0.2 ms of CPU read directly against 3.8 ms through the page cache,
and a warm 1 KiB chunk 70 µs read directly against 4 µs from the cache). Elsewhere (tmpfs) it
reads through the page cache.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
from concurrent.futures import Future

import crc32c
import numpy as np
import tensorstore as ts

from jaxstream.stream.chunk_write import remove_temporaries, write_chunk
from jaxstream.stream.errors import StoreCorruptError, not_committed
from jaxstream.stream.store_parts import ALIGN


class BufferPool:
    """Aligned byte buffers that are reused once nothing refers to them any more.

    A buffer handed out by :meth:`take` is a view of an owner array kept here; every array
    made from it (reshaped views, a device array that aliases it, a TensorStore array over
    it) holds a reference to that owner, so the owner's reference count says whether any of
    them is still alive. Only then is a buffer free to be read into again. At most ``keep``
    owners per size and ``max_bytes`` in all are kept (the prefetcher has about depth + 2
    layers alive at a time); a buffer beyond that is an ordinary array.

    Example::

        buf = BUFFERS.take(4096)   # uint8, 4096 bytes, data aligned to 64 bytes
    """

    def __init__(self, keep: int = 8, max_bytes: int = 1 << 30, align: int = ALIGN):
        self._keep, self._max_bytes, self._align = keep, max_bytes, align
        self._owners: dict[int, list[np.ndarray]] = {}
        self._kept = 0  # bytes held by the kept owners
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """An uninitialised aligned uint8 array of ``nbytes`` that nothing else refers to."""
        with self._lock:
            owners = self._owners.setdefault(nbytes, [])
            for owner in owners:
                # references: the list, this loop's variable, getrefcount's argument
                if sys.getrefcount(owner) <= _FREE_REFS:
                    return self._view(owner, nbytes)
            owner = np.empty(nbytes + self._align, np.uint8)
            if len(owners) < self._keep and self._kept + owner.nbytes <= self._max_bytes:
                owners.append(owner)
                self._kept += owner.nbytes
            return self._view(owner, nbytes)

    def _view(self, owner: np.ndarray, nbytes: int) -> np.ndarray:
        off = (-owner.ctypes.data) % self._align
        return owner[off:off + nbytes]

    def clear(self) -> None:
        """Drops the kept buffers (arrays still using them stay valid)."""
        with self._lock:
            self._owners.clear()
            self._kept = 0


_FREE_REFS = 3
DIRECT_BLOCK = 4096  # O_DIRECT transfers whole, aligned blocks
BUFFERS = BufferPool(align=DIRECT_BLOCK)
"""The buffers of every direct chunk read in this process."""


CRC_BYTES = 4  # the zarr3 crc32c codec appends the chunk's crc32c, little-endian
_DIRECT_CODECS = ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                  [{"name": "bytes"}, {"name": "crc32c"}])


class FileChunks:
    """Whole-chunk reads of a zarr3 array on a local ``file`` kvstore, bypassing TensorStore.

    Only arrays whose chunks are raw little-endian bytes followed by a crc32c (the store's
    layout, :func:`jaxstream.stream.layout.array_spec`) with the default ``c/i/j/...`` chunk
    keys get this path; :meth:`of` returns None for any other array (a ``memory://`` or
    remote kvstore, another codec chain), which keeps the TensorStore read. The checks are
    TensorStore's, and stricter: a missing chunk, a chunk file of any size other than the
    leaf's bytes + 4, and a checksum mismatch are :class:`StoreCorruptError`.

    Example::

        direct = FileChunks.of(arr, 2)         # arr: params/blocks/<leaf>, shape (L, 2, *leaf)
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

    def file(self, index: tuple[int, ...]) -> str:
        """The chunk file at ``index`` (one per leading axis)."""
        return self._path + "/".join(str(int(i)) for i in index) + self._tail

    def read(self, index: tuple[int, ...], what: str, expect: int | None = None) -> ChunkRead:
        """A read of the chunk at ``index`` (one per leading axis); ``what`` names it in errors;
        ``expect``: the crc32c the chunk must hold (the manifest's record of what was committed
        there), or None."""
        return ChunkRead(self.file(index), self._leaf_shape, self._dtype, what, expect)

    def remove_temporaries(self) -> int:
        """Removes the temporary files killed writers left among the chunks (the count)."""
        return remove_temporaries(self._path)

    def write(self, index: tuple[int, ...], x: np.ndarray, crc: int, sync: bool = True) -> Future:
        """Writes ``x`` (the leaf's dtype and shape) and its crc32c ``crc`` as the chunk at
        ``index``, as TensorStore would (:mod:`~jaxstream.stream.chunk_write`)."""
        return write_chunk(self.file(index), x, crc, sync)


def _open(file: str, what: str, direct: bool = True) -> tuple[int, bool]:
    """``(fd, direct)``: the chunk file opened with ``O_DIRECT`` where the file system allows
    it (the bytes go from the disk into the buffer: no page-cache copy, less CPU and memory
    traffic beside the compute), else a plain read-only descriptor. Asked per file (one
    refused syscall on a file system without it, e.g. tmpfs), so stores on different file
    systems each get what theirs allows. ``direct=False``: a plain descriptor."""
    flags = os.O_RDONLY
    try:
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(file, flags | os.O_DIRECT), True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
        return os.open(file, flags), False
    except FileNotFoundError as err:
        raise StoreCorruptError(f"{what}: the chunk is missing ({file})") from err


def _from_cache(fd: int, buf: np.ndarray) -> int:
    """Bytes of ``fd`` (from its start) copied into ``buf`` from the page cache, never waiting
    for the disk (``RWF_NOWAIT``): 0 where nothing is cached or the system cannot say."""
    flag = getattr(os, "RWF_NOWAIT", None)
    got = 0
    while flag is not None and got < buf.nbytes:
        try:
            n = os.preadv(fd, [buf[got:]], got, flag)
        except BlockingIOError:  # the rest is not in the page cache
            break
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                break
            raise
        if n == 0:
            break
        got += n
    return got


def _read_into(fd: int, buf: np.ndarray, direct: bool, got: int = 0) -> int:
    """Bytes read from offset ``got`` of ``fd`` into ``buf`` until the end of the file or of
    ``buf`` (``got`` counted in). A direct read that the kernel refuses is finished with a
    buffered one."""
    while got < buf.nbytes:
        try:
            n = os.preadv(fd, [buf[got:]], got)
        except OSError as err:
            if not direct or err.errno != errno.EINVAL:
                raise
            direct = False
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
            continue
        if n == 0:
            break
        got += n
    return got


class ChunkRead:
    """One chunk file read into a 4096-byte aligned array and checked against its crc32c.

    The read runs when :meth:`result` is first called, on the caller's thread (a prefetch
    worker): ``os.preadv`` and ``crc32c`` both release the GIL. The buffer comes from
    :data:`BUFFERS` (no page faults on memory that an earlier read already touched).
    """

    def __init__(self, file: str, shape: tuple[int, ...], dtype: np.dtype, what: str,
                 expect: int | None = None):
        self._file, self._shape, self._dtype, self._what = file, shape, dtype, what
        self._expect = expect
        self._out: np.ndarray | None = None

    def done(self) -> bool:
        return self._out is not None

    def result(self) -> np.ndarray:
        if self._out is None:
            self._out = self._read()
        return self._out

    def _read(self) -> np.ndarray:
        nbytes = int(np.prod(self._shape, dtype=np.int64)) * self._dtype.itemsize
        want = nbytes + CRC_BYTES
        buf = BUFFERS.take(-(-want // DIRECT_BLOCK) * DIRECT_BLOCK)  # whole blocks: O_DIRECT
        fd, direct = _open(self._file, self._what, direct=False)
        try:
            size = os.fstat(fd).st_size
            got = _from_cache(fd, buf)
            if got == 0 and size > 0:  # not cached: from the disk, O_DIRECT where allowed
                os.close(fd)
                fd, direct = _open(self._file, self._what)
            got = _read_into(fd, buf, direct and got == 0, got)
        finally:
            os.close(fd)
        if size != want or got != want:
            raise StoreCorruptError(f"{self._what}: the chunk is truncated or malformed "
                                    f"({self._file} holds {size} bytes, expected {want})")
        buf = buf[:want]
        stored = int.from_bytes(buf[nbytes:].tobytes(), "little")
        if crc32c.crc32c(buf[:nbytes]) != stored:
            raise StoreCorruptError(f"{self._what}: checksum mismatch, the chunk is damaged "
                                    f"({self._file})")
        if self._expect is not None and stored != self._expect:
            raise not_committed(self._what, self._file)
        return buf[:nbytes].view(self._dtype).reshape(self._shape)

