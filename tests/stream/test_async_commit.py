"""Commits off the critical path (``StreamConfig(async_commit=True)``): step t's manifest is
written and fsynced while step t + 1 computes. The steps give the same parameters as
committing in line; a failed commit is a clean error raised by the next step before it
writes anything, and the store, in memory and on disk, is then back at the step before."""

from __future__ import annotations

import threading

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream import store_commit as store_mod
from jaxstream.stream.errors import StoreWriteError
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(6, 8, 3, 3)
SGD = optax.sgd(0.1)
EST = jg.hybrid(num_exact=2, num_tangents=2)


def _batch(t: int) -> dict:
    r = np.random.default_rng(t)
    return {"x": r.standard_normal((4, 3, 6), dtype=np.float32), "y": r.integers(0, 3, (4, 3))}


def _run(path, steps: int, async_commit: bool, update: str = "lazy") -> LayerStore:
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=SGD)
    ex = StreamedExecutor(STACK, EST, SGD, store, StreamConfig(
        compute_dtype="float32", update=update, async_commit=async_commit))
    for t in range(steps):
        ex.step(_batch(t), jax.random.key(t))
    return store


def _leaves(tree) -> list:
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def test_async_commits_give_the_steps_in_line_commits_give(tmp_path):
    sync = _run(tmp_path / "sync", 3, False)
    lazy = _run(tmp_path / "async", 3, True)
    assert lazy.step == 3  # this handle sees its last step at once
    lazy.settle()
    disk = LayerStore.open(tmp_path / "async")
    assert disk.step == 3 and disk.extra == sync.extra
    for a, b in zip(_leaves(disk.read_params()), _leaves(sync.read_params())):
        np.testing.assert_array_equal(a, b)


def test_failed_commit_stops_the_next_step_before_it_writes(tmp_path, monkeypatch):
    store = LayerStore.create(tmp_path / "s", STACK.init(jax.random.key(0)), optimizer=SGD)
    ex = StreamedExecutor(STACK, EST, SGD, store, StreamConfig(
        compute_dtype="float32", update="eager", async_commit=True))
    ex.step(_batch(0), jax.random.key(0))
    store.settle()
    at_one = _leaves(store.read_params())
    real = store_mod.write_manifest

    called = threading.Event()

    def failing(root, m, where):
        called.set()
        raise StoreWriteError(f"writing the manifest of step {m['step']} failed (disk full)")

    monkeypatch.setattr(store_mod, "write_manifest", failing)
    ex.step(_batch(1), jax.random.key(1))  # its commit fails on the landing thread
    assert called.wait(60)  # (the landing waits for the step's writes first)
    monkeypatch.setattr(store_mod, "write_manifest", real)
    with pytest.raises(StoreWriteError, match="manifest of step 2 failed"):
        ex.step(_batch(2), jax.random.key(2))
    assert store.step == 1  # back at the last step that landed, in memory...
    disk = LayerStore.open(tmp_path / "s")
    assert disk.step == 1  # ... and on disk, with its parameters intact
    for a, b in zip(_leaves(disk.read_params()), at_one):
        np.testing.assert_array_equal(a, b)
    ex.step(_batch(1), jax.random.key(1), step=1)  # and training goes on from there
    store.settle()
    assert LayerStore.open(tmp_path / "s").step == 2


def test_a_failed_chunk_write_on_the_landing_thread_is_raised_once(tmp_path, monkeypatch):
    """A chunk write that fails while its commit lands (a full disk) fails the next step once,
    naming the write; the store is back at the step before; the first retry after the disk
    has room trains on (before, the same error was raised again by the retry)."""
    from jaxstream.stream import chunk_write

    store = LayerStore.create(tmp_path / "s", STACK.init(jax.random.key(0)), optimizer=SGD)
    ex = StreamedExecutor(STACK, EST, SGD, store, StreamConfig(
        compute_dtype="float32", update="eager", async_commit=True))
    ex.step(_batch(0), jax.random.key(0))
    store.settle()
    real = chunk_write._write
    full = {"on": True}

    def write(file, x, crc, sync):
        if full["on"] and "/blocks/" in file:
            raise OSError(28, "No space left on device")
        return real(file, x, crc, sync)

    monkeypatch.setattr(chunk_write, "_write", write)
    ex.step(_batch(1), jax.random.key(1))  # returns: its writes fail on the landing thread
    with pytest.raises(StoreWriteError, match="No space left on device"):
        ex.step(_batch(2), jax.random.key(2))
    assert store.step == 1
    full["on"] = False  # the disk has room again
    ex.step(_batch(1), jax.random.key(1), step=1)  # the first retry trains on
    store.settle()
    assert LayerStore.open(tmp_path / "s").step == 2
