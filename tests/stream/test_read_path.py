"""The store's read path: direct chunk-file reads on a local store equal TensorStore's reads,
return aligned arrays, and refuse every damage TensorStore refuses (checksum, size, missing)."""

from __future__ import annotations

import gc
import glob
import os
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import tensorstore as ts

from jaxstream.stream import LayerStore, direct_read
from jaxstream.stream.direct_read import BufferPool, FileChunks
from jaxstream.stream.errors import StoreCorruptError
from jaxstream.stream.layout import make_context, open_array, open_kvstore
from jaxstream.stream.store_parts import ALIGN


def _params(layers=3):
    r = np.random.default_rng(1)
    return {"embed": {"w": r.standard_normal((5, 4), dtype=np.float32)},
            "blocks": {"b": r.standard_normal((layers, 4), dtype=np.float32),
                       "w": r.standard_normal((layers, 4, 3), dtype=np.float32)},
            "head": {"w": r.standard_normal((4, 2), dtype=np.float32)}}


def _tensorstore_path(store: LayerStore) -> LayerStore:
    """The same handle reading through TensorStore (the path of non-file kvstores)."""
    store._direct = dict.fromkeys(store._direct)
    return store


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("read") / "s")
    store = LayerStore.create(path, _params(), optimizer=optax.adam(1e-3))
    store.write(1, {"b": np.ones(4, np.float32), "w": np.full((4, 3), 2.0, np.float32)})
    store.commit(1)  # layer 1 now lives in slot 1, the others in slot 0
    return path


def test_local_store_reads_every_leaf_directly(store_path):
    store = LayerStore.open(store_path, optimizer=optax.adam(1e-3))
    assert all(isinstance(d, FileChunks) for d in store._direct.values()), store._direct


@pytest.mark.parametrize("mode", ["cache", "o_direct", "buffered", "part_cached"])
@pytest.mark.parametrize("unit", [0, 1, 2, "embed", "head"])
def test_direct_read_equals_tensorstore_read(store_path, unit, mode, monkeypatch):
    """Chunk files read from the page cache, with O_DIRECT (nothing cached, where the file
    system allows it), with buffered reads (tmpfs, or a refused O_DIRECT) and partly from the
    cache (the rest buffered) all equal TensorStore's read."""
    if mode in ("o_direct", "buffered"):  # the page cache serves nothing
        monkeypatch.setattr(direct_read, "_from_cache", lambda fd, buf: 0)
    if mode == "buffered":
        monkeypatch.delattr(os, "O_DIRECT")  # the buffered path, as where O_DIRECT is missing
    if mode == "part_cached":  # the cache holds the chunk's first 8 bytes only
        monkeypatch.setattr(direct_read, "_from_cache",
                            lambda fd, buf: os.preadv(fd, [buf[:8]], 0))
    direct = LayerStore.open(store_path, optimizer=optax.adam(1e-3))
    ref = _tensorstore_path(LayerStore.open(store_path, optimizer=optax.adam(1e-3)))
    for read in ("read", "read_opt"):  # fp32 leaves and adam's int32 count (a scalar leaf)
        got, want = getattr(direct, read)(unit).result(), getattr(ref, read)(unit).result()
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
            assert a.ctypes.data % ALIGN == 0 or a.nbytes == 0  # the CPU client aliases it
    if unit == 1:
        np.testing.assert_array_equal(direct.read(1).result()["w"], np.full((4, 3), 2.0))


def test_cached_chunks_come_from_the_page_cache_others_from_the_disk(store_path, monkeypatch):
    """A chunk the page cache holds is copied from it; one dropped from it (a model larger
    than memory) is read from the disk (``O_DIRECT`` where allowed: the page cache stays
    clean)."""
    if not hasattr(os, "RWF_NOWAIT") or not hasattr(os, "posix_fadvise"):
        pytest.skip("no RWF_NOWAIT / posix_fadvise here")
    served: list[int] = []
    real = direct_read._from_cache
    monkeypatch.setattr(direct_read, "_from_cache",
                        lambda fd, buf: served.append(real(fd, buf)) or served[-1])
    store = LayerStore.open(store_path, optimizer=optax.adam(1e-3))
    files = [f for f in Path(store_path).rglob("*") if f.is_file() and "/c/" in str(f)]
    for f in files:  # durable, then warm: read once through the page cache
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd), os.pread(fd, 1 << 20, 0), os.close(fd)
    want = store.read(2).result()
    if not all(served):
        pytest.skip("this file system does not serve RWF_NOWAIT reads from the page cache")
    served.clear()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED), os.close(fd)
    got = store.read(2).result()
    assert served and not any(served), served  # nothing came from the cache
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_memory_store_reads_through_tensorstore():
    store = LayerStore.create("memory://", _params())
    assert set(store._direct.values()) == {None}
    np.testing.assert_array_equal(store.read(2).result()["w"], _params()["blocks"]["w"][2])


def test_other_chunking_or_codecs_read_through_tensorstore(tmp_path):
    ctx = make_context(file_io_sync=False)
    root = open_kvstore(tmp_path, ctx)
    whole = open_array(root, "whole", ctx, create=True, shape=(2, 3), chunk=(2, 3))
    assert FileChunks.of(whole, 1) is None  # a chunk holds two rows
    plain = ts.open({"driver": "zarr3", "kvstore": (root / "plain/").spec().to_json(),
                     "metadata": {"shape": [2, 3], "data_type": "float32",
                                  "chunk_grid": {"name": "regular",
                                                 "configuration": {"chunk_shape": [1, 3]}}}},
                    create=True, context=ctx).result()
    assert FileChunks.of(plain, 1) is None  # no crc32c codec: TensorStore reads it


def _chunk(root, layer, slot):
    base = os.path.join(root, "params", "blocks", "1", "c", str(layer), str(slot))
    return min(f for f in glob.glob(base + "/**", recursive=True) if os.path.isfile(f))


# TensorStore reads a chunk with trailing bytes as if they were not there; the direct path
# refuses any chunk file whose size is not the leaf's bytes + 4
_DAMAGE = [(p, d) for p in ("direct", "tensorstore")
           for d in ("data_bit", "crc_bit", "extra_byte", "short", "missing")
           if (p, d) != ("tensorstore", "extra_byte")]


@pytest.mark.parametrize("path, damage", _DAMAGE)
def test_damage_is_refused_by_both_paths(tmp_path, path, damage):
    root = str(tmp_path / "s")
    LayerStore.create(root, _params())
    f = Path(_chunk(root, 2, 0))
    data = bytearray(f.read_bytes())
    if damage == "data_bit":
        data[5] ^= 0x01
    elif damage == "crc_bit":
        data[-1] ^= 0x80
    elif damage == "extra_byte":
        data += b"\0"
    elif damage == "short":
        data = data[:-5]
    if damage == "missing":
        f.unlink()
    else:
        f.write_bytes(bytes(data))
    store = LayerStore.open(root)
    if path == "tensorstore":
        _tensorstore_path(store)
    with pytest.raises(StoreCorruptError, match=r"leaf 'w' of layer 2 \(slot 0\)"):
        store.read(2).result()
    np.testing.assert_array_equal(store.read(1).result()["w"], _params()["blocks"]["w"][1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_to_device_casts_floating_leaves_only(dtype):
    import jax.numpy as jnp

    from jaxstream.stream.prefetch import to_device

    tree = {"w": np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4), "n": np.arange(3, dtype=np.int32)}
    got = to_device(tree, jnp.dtype(dtype), jax.devices()[0])
    assert got["w"].dtype == jnp.dtype(dtype) and got["n"].dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got["w"]), tree["w"].astype(jnp.dtype(dtype)))
    np.testing.assert_array_equal(np.asarray(got["n"]), tree["n"])


def test_buffer_pool_never_hands_out_a_buffer_in_use():
    pool = BufferPool(keep=2)
    a = pool.take(400)
    first = a.ctypes.data
    assert first % ALIGN == 0 and a.nbytes == 400
    view = a.view(np.float32).reshape(10, 10)  # what a read returns
    view[...] = np.arange(100, dtype=np.float32).reshape(10, 10)
    want = view.copy()
    dev = jax.device_put(view)  # the CPU client may alias it: then it keeps it alive too
    del a, view
    taken = [pool.take(400) for _ in range(3)]
    for t in taken:
        t[...] = 0xFF
    np.testing.assert_array_equal(np.asarray(dev), want)
    del taken, dev
    gc.collect()  # a device array may sit in a reference cycle until collected
    assert pool.take(400).ctypes.data == first  # kept, and nothing refers to it any more
