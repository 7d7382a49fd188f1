"""A layer store and a data store describe themselves: plain zarr opens the root group and
names every array; a layer's current slot read with plain zarr (and plain TensorStore), found
from manifest.json alone, equals what jaxstream reads."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest
import tensorstore as ts

from jaxstream.models import mlp
from jaxstream.stream.data_store import DataStore
from jaxstream.stream.store import LayerStore


@pytest.fixture
def trained_store(tmp_path):
    stack = mlp(6, 5, 3, 4)
    params = stack.init(jax.random.key(0))
    store = LayerStore.create(str(tmp_path / "s"), params, optimizer=optax.adam(1e-2))
    new = jax.tree.map(lambda a: np.asarray(a) + 1.0, params)
    store.write(1, jax.tree.map(lambda a: a[1], new["blocks"]))  # layer 1 moves to slot 1
    store.commit(1)
    return tmp_path / "s", store


def test_plain_zarr_reads_the_current_slot(trained_store):
    zarr = pytest.importorskip("zarr")
    path, store = trained_store
    manifest = json.loads((path / "manifest.json").read_text())
    root = zarr.open_group(str(path), mode="r")
    assert root.attrs["jaxstream"]["commit_record"] == "manifest.json"
    blocks = root["params"]["blocks"]
    names = {k: blocks[k].attrs["jaxstream"]["leaf"] for k in blocks.array_keys()}
    assert sorted(names.values()) == sorted(e["name"] for e in manifest["leaves"]["params"]
                                            ["blocks"])
    ours = store.read(1).result()
    flat = dict(zip([e["name"] for e in manifest["leaves"]["params"]["blocks"]],
                    jax.tree.leaves(ours)))
    slot = manifest["slots"]["blocks"][1]
    assert slot == 1
    for key, leaf in names.items():
        assert blocks[key].attrs["jaxstream"]["dims"][:2] == ["layer", "slot"]
        np.testing.assert_array_equal(blocks[key][1, slot], flat[leaf])
    # plain TensorStore, from the array's own metadata
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                                                  "path": str(path / "params/blocks/0")}}).result()
    np.testing.assert_array_equal(arr[1, slot].read().result(), flat[names["0"]])
    store.close()


def test_plain_zarr_reads_a_data_store(tmp_path):
    zarr = pytest.importorskip("zarr")
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    DataStore.create(str(tmp_path / "d"), {"x": x, "y": np.arange(6)}, chunk_samples=4)
    root = zarr.open_group(str(tmp_path / "d"), mode="r")
    assert root["fields"]["x"].attrs["jaxstream"]["field"] == "x"
    np.testing.assert_array_equal(root["fields"]["x"][:], x)
