"""A local store's chunk files written directly: TensorStore reads what they hold, a copy made
with hard links keeps its own files, a failed write leaves the old chunk and no temporary
file, and ``file_io_sync: false`` skips the syncs."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import optax
import pytest

from jaxstream.stream import LayerStore, chunk_write

L, W = 3, 5


def _params():
    r = np.random.default_rng(0)
    return {"embed": {"w": r.normal(size=(2, W)).astype(np.float32)},
            "blocks": {"w": r.normal(size=(L, W, W)).astype(np.float32),
                       "b": r.normal(size=(L, W)).astype(np.float32)},
            "head": {"w": r.normal(size=(W, 2)).astype(np.float32)}}


def _layer(v: float) -> dict:
    return {"b": np.full(W, v, np.float32), "w": np.full((W, W), v, np.float32)}


def _tensorstore_read(path, unit):
    """The unit's params as TensorStore reads them (the direct read path off)."""
    store = LayerStore.open(path, optimizer=optax.sgd(0.1))
    store._direct = dict.fromkeys(store._direct)
    return store.read(unit).result()


def _chunk_files(path) -> list[Path]:
    return [f for f in Path(path).rglob("*") if f.is_file() and "/c/" in str(f)]


def test_tensorstore_reads_what_direct_writes_hold(tmp_path):
    path = tmp_path / "s"
    store = LayerStore.create(path, _params(), optimizer=optax.sgd(0.1))
    assert all(store._direct.values())  # every leaf of a local store is written directly
    store.write(1, _layer(2.5))
    store.write("head", {"w": np.full((W, 2), -1.0, np.float32)})
    store.commit(1)
    got = _tensorstore_read(path, 1)
    np.testing.assert_array_equal(got["w"], np.full((W, W), 2.5))
    np.testing.assert_array_equal(got["b"], np.full(W, 2.5))
    np.testing.assert_array_equal(_tensorstore_read(path, "head")["w"], np.full((W, 2), -1.0))
    assert not [f for f in Path(path).rglob("*.__write.*")]  # no temporary file left


def test_a_hard_linked_copy_keeps_its_own_chunks(tmp_path):
    path, copy = tmp_path / "s", tmp_path / "copy"
    store = LayerStore.create(path, _params(), optimizer=optax.sgd(0.1))
    store.write(1, _layer(1.0))
    store.commit(1)
    for f in Path(path).rglob("*"):  # cp -al: every file a hard link
        dst = copy / f.relative_to(path)
        if f.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dst)
    for step in (2, 3):  # both slots of layer 1 written again in the original
        store.write(1, _layer(float(step)))
        store.commit(step)
    copied = LayerStore.open(copy, optimizer=optax.sgd(0.1))
    assert copied.step == 1
    np.testing.assert_array_equal(copied.read(1).result()["w"], np.full((W, W), 1.0))


def test_a_failed_write_leaves_the_old_chunk_and_no_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "s"
    store = LayerStore.create(path, _params(), optimizer=optax.sgd(0.1))
    before = {f: f.read_bytes() for f in _chunk_files(path)}

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(chunk_write.os, "pwritev", full)
    fut = store._direct[("params", "blocks", 1)].write((1, 1), np.ones((W, W), np.float32), 0)
    with pytest.raises(OSError, match="No space left"):
        fut.result()
    assert {f: f.read_bytes() for f in _chunk_files(path)} == before  # nothing changed
    assert not [f for f in Path(path).rglob("*.__write.*")]


@pytest.mark.parametrize("sync", [True, False])
def test_syncs_follow_file_io_sync(tmp_path, monkeypatch, sync):
    store = LayerStore.create(tmp_path / "s", _params(), optimizer=optax.sgd(0.1),
                              file_io_sync=sync)
    synced: list = []
    for name in ("fdatasync", "fsync"):
        real = getattr(os, name)
        monkeypatch.setattr(chunk_write.os, name,
                            lambda fd, real=real, name=name: synced.append(name) or real(fd))
    store.write(1, _layer(3.0))
    store.commit(1)
    # per chunk (2 leaves, written on two threads): its data and its directory (the
    # manifest's own write is not here)
    assert sorted(synced) == (["fdatasync"] * 2 + ["fsync"] * 2 if sync else []), synced
    np.testing.assert_array_equal(_tensorstore_read(tmp_path / "s", 1)["w"], np.full((W, W), 3.0))


def test_a_store_made_again_at_a_removed_path_trains(tmp_path):
    """A notebook cell run twice (remove the store, create it again) wrote into folders the
    first store had made and the process remembered: ENOENT on the first write."""
    import shutil

    path = tmp_path / "s"
    for attempt in range(2):
        shutil.rmtree(path, ignore_errors=True)
        store = LayerStore.create(path, _params(), optimizer=optax.sgd(0.1))
        store.write(1, _layer(float(attempt)))
        store.commit(1)
        np.testing.assert_array_equal(store.read(1).result()["w"], np.full((W, W), attempt))
        store.close()


def test_temporary_files_of_killed_writers_are_removed_by_the_next_writer(tmp_path):
    path = tmp_path / "s"
    store = LayerStore.create(path, _params(), optimizer=optax.sgd(0.1))
    chunk = _chunk_files(path)[0]
    left = [Path(f"{chunk}.__write.4242.{t}") for t in (1, 2)]  # a killed writer's two threads
    for f in left:
        f.write_bytes(b"partial")
    store.close()
    store = LayerStore.open(path, optimizer=optax.sgd(0.1))
    assert all(f.exists() for f in left)  # a reader leaves them (a writer may be running)
    store.write(1, _layer(1.0))  # the writer, holding the lock, removes them first
    store.commit(1)
    assert not any(f.exists() for f in left)
    assert not [f for f in Path(path).rglob("*.__write.*")]
