"""LayerStore / DataStore: round trips, atomic commits, and clear errors."""

from __future__ import annotations

import errno

import numpy as np
import optax
import pytest

from jaxstream.stream import DataStore, LayerStore
from jaxstream.stream.errors import (
    StoreError,
    StoreMismatchError,
    StoreNotFoundError,
    StoreWriteError,
)


def _params(seed=0, layers=3, width=4):
    r = np.random.default_rng(seed)
    return {
        "embed": {"w": r.standard_normal((5, width), dtype=np.float32)},
        "blocks": {"w": r.standard_normal((layers, width, width), dtype=np.float32),
                   "b": r.standard_normal((layers, width), dtype=np.float32)},
        "head": {"w": r.standard_normal((width, 2), dtype=np.float32)},
    }


def _assert_tree_equal(a, b):
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_bitwise(tmp_path):
    p = _params()
    store = LayerStore.create(tmp_path / "s", p, optimizer=optax.adam(1e-3), model_config={"depth": 3})
    _assert_tree_equal(store.read_params(), p)
    reopened = LayerStore.open(tmp_path / "s", template=p, optimizer=optax.adam(1e-3))
    _assert_tree_equal(reopened.read_params(), p)
    assert reopened.step == 0 and reopened.model_config == {"depth": 3}
    opt = reopened.read_opt(1).result()
    assert int(opt[0].count) == 0


def test_memory_kvstore_spec(tmp_path):
    p = _params()
    store = LayerStore.create("memory://", p)
    _assert_tree_equal(store.read_params(), p)


def test_staged_writes_invisible_until_commit(tmp_path):
    p = _params()
    store = LayerStore.create(tmp_path / "s", p, optimizer=optax.sgd(0.1))
    new = {"b": np.full((4,), 7, np.float32), "w": np.full((4, 4), 7, np.float32)}
    store.write(1, new)
    store.write("head", {"w": np.zeros((4, 2), np.float32)})
    _assert_tree_equal(store.read(1).result(), {"b": p["blocks"]["b"][1], "w": p["blocks"]["w"][1]})
    _assert_tree_equal(store.read(1, staged=True).result(), new)
    _assert_tree_equal(LayerStore.open(tmp_path / "s").read_params(), p)  # other process view
    store.commit(step=1, extra={"note": "x"})
    again = LayerStore.open(tmp_path / "s")
    assert again.step == 1 and again.extra == {"note": "x"}
    _assert_tree_equal(again.read(1).result(), new)
    # a second step writes the other slot; the committed slot of step 1 stays readable
    store.write(1, {"b": np.zeros(4, np.float32), "w": np.zeros((4, 4), np.float32)})
    _assert_tree_equal(LayerStore.open(tmp_path / "s").read(1).result(), new)


def test_missing_store(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no layer store"):
        LayerStore.open(tmp_path / "nothing")


def test_store_of_another_model(tmp_path):
    LayerStore.create(tmp_path / "s", _params(), model_config={"depth": 3, "width": 4})
    with pytest.raises(StoreMismatchError, match="'width'"):
        LayerStore.open(tmp_path / "s", model_config={"depth": 3, "width": 8})
    with pytest.raises(StoreMismatchError, match="shape"):
        LayerStore.open(tmp_path / "s", template=_params(width=6))
    with pytest.raises(StoreMismatchError, match="num_layers"):
        LayerStore.open(tmp_path / "s", template=_params(layers=5))
    with pytest.raises(StoreError, match="already exists"):
        LayerStore.create(tmp_path / "s", _params())


class _FullDisk:
    """Wraps a TensorStore array so that writes fail like a full disk (ENOSPC)."""

    def __init__(self, arr, fail_at_result):
        self._arr, self._late = arr, fail_at_result

    def __getitem__(self, idx):
        return _FullDiskView(self._arr[idx], self._late)


class _FullDiskView:
    def __init__(self, view, late):
        self._view, self._late = view, late

    def read(self):
        return self._view.read()

    def write(self, x):
        err = OSError(errno.ENOSPC, "No space left on device")
        if not self._late:
            raise err

        class _Fut:
            def result(self):
                raise err

        return _Fut()


class _FullDiskFiles:
    """Wraps a store's direct chunk files so that writes fail like a full disk: at once, or
    (``late``) when the write's future is waited for."""

    def __init__(self, chunks, late):
        self._chunks, self._late = chunks, late

    def read(self, *args, **kwargs):
        return self._chunks.read(*args, **kwargs)

    def write(self, *args, **kwargs):
        return _FullDiskView(None, self._late).write(None)


@pytest.mark.parametrize("path", ["direct", "tensorstore"])
@pytest.mark.parametrize("late", [False, True])
def test_full_disk_keeps_last_commit(tmp_path, late, path):
    p = _params()
    store = LayerStore.create(tmp_path / "s", p, optimizer=optax.sgd(0.1))
    step1 = {"b": np.ones(4, np.float32), "w": np.ones((4, 4), np.float32)}
    store.write(0, step1)
    store.commit(1)
    key = ("params", "blocks", 1)  # leaf 1 of a layer ("w") fails
    assert store._direct[key] is not None  # a local store writes its chunk files itself
    if path == "direct":
        store._direct[key] = _FullDiskFiles(store._direct[key], late)
    else:  # a store TensorStore writes (another kvstore)
        store._direct[key] = None
        store._arrays[key] = _FullDisk(store._arrays[key], late)
    with pytest.raises(StoreWriteError, match="committed step 1"):
        store.write(0, jax_zeros_like(step1))
        store.write(2, jax_zeros_like(step1))
        store.commit(2)
    reopened = LayerStore.open(tmp_path / "s")
    assert reopened.step == 1
    _assert_tree_equal(reopened.read(0).result(), step1)
    _assert_tree_equal(reopened.read(2).result(), {"b": p["blocks"]["b"][2], "w": p["blocks"]["w"][2]})


def test_failed_manifest_write_keeps_last_commit(tmp_path, monkeypatch):
    from jaxstream.stream import store_commit as store_mod

    p = _params()
    store = LayerStore.create(tmp_path / "s", p)
    store.write(0, jax_zeros_like({"b": p["blocks"]["b"][0], "w": p["blocks"]["w"][0]}))

    def boom(root, manifest, where):
        raise StoreWriteError("writing manifest.json failed (No space left on device)")

    monkeypatch.setattr(store_mod, "write_manifest", boom)
    with pytest.raises(StoreWriteError):
        store.commit(1)
    monkeypatch.undo()
    reopened = LayerStore.open(tmp_path / "s")
    assert reopened.step == 0
    _assert_tree_equal(reopened.read_params(), p)


def jax_zeros_like(tree):
    import jax

    return jax.tree.map(np.zeros_like, tree)


def test_data_store(tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20, dtype=np.int32)
    ds = DataStore.create(tmp_path / "d", {"x": x, "y": y}, chunk_samples=8)
    idx = np.array([[3, 17], [0, 9]])
    got = DataStore.open(tmp_path / "d").read(idx)
    np.testing.assert_array_equal(got["x"], x[idx])
    np.testing.assert_array_equal(got["y"], y[idx])
    with pytest.raises(StoreError, match=r"indices must be in \[0, 20\)"):
        ds.read(np.array([20]))
    with pytest.raises(StoreNotFoundError, match="no data store"):
        DataStore.open(tmp_path / "none")


def test_scratch_writes_in_flight_are_bounded(tmp_path):
    """write_scratch waits for the oldest writes once more than max_write_bytes are in
    flight: a slow disk must not pile a step's exact gradients up in host memory."""
    import threading

    import tensorstore as ts

    store = LayerStore.create(tmp_path / "s", _params(layers=6))
    layer = {"b": np.ones(4, np.float32), "w": np.ones((4, 4), np.float32)}
    store.max_write_bytes = 80  # one layer: 16 + 64 bytes
    promises: list = []

    class SlowDisk:  # a scratch array whose writes finish when the test says so
        def __getitem__(self, idx):
            return self

        def write(self, x):
            promise, future = ts.Promise.new()
            promises.append(promise)
            return future

    store._scratch_array = lambda part, i: SlowDisk()
    done = threading.Event()

    def writer():
        for l in range(6):
            store.write_scratch(l, layer)
        done.set()

    threading.Thread(target=writer, daemon=True).start()
    assert not done.wait(0.5), "six layers staged while the first writes were in flight"
    assert len(promises) == 4  # layer 0 within the bound; layer 1 waits for layer 0
    finished = 0
    while not done.wait(0.02) or finished < len(promises):  # the disk catches up
        for p in promises[finished:]:
            p.set_result(None)
            finished += 1
    assert finished == 12  # two leaves per layer, every one written
    store.abort()


def _layer(v, width=4):
    return {"w": np.full((width, width), v, np.float32), "b": np.full((width,), v, np.float32)}


def test_the_losing_writer_is_told_another_writer_is_active(tmp_path):
    """A writer whose store another process has moved on hears that another writer is active
    (naming its pid and host), not that a chunk was swapped or rolled back."""
    import os
    import socket

    from jaxstream.stream.errors import StoreLockedError, StoreStaleError

    path = str(tmp_path / "s")
    adam = optax.adam(1e-3)
    LayerStore.create(path, _params(), optimizer=adam)
    loser = LayerStore.open(path, optimizer=adam)
    loser.read(0).result()
    loser.write(0, _layer(1.0))
    loser.commit(1)
    winner = LayerStore.open(path, optimizer=adam)
    for step in (2, 3):  # the winner overwrites the slot the loser's step 1 committed
        winner.read(0).result()
        winner.write(0, _layer(float(step)))
        winner.commit(step)
    who = f"pid {os.getpid()} on {socket.gethostname()}"
    with pytest.raises(StoreStaleError, match=rf"another writer is active .* committed step 3 "
                                              rf"\({who}\).*One writer per store"):
        loser.read(0).result()
    winner.write(1, _layer(4.0))  # mid-step: the winner holds the writer lock
    with pytest.raises(StoreStaleError, match=rf"step 3 \({who}\); {who} holds its writer lock"):
        loser.read(0).result()
    with pytest.raises(StoreLockedError, match=rf"another writer is active .*\(pid {os.getpid()}"):
        LayerStore.open(path, optimizer=adam).write(2, _layer(6.0))
    winner.commit(4)
