"""DataStore: training samples in TensorStore, read by index (the data half of the split).

Each field (e.g. "x", "y") is one zarr3 array with the sample axis first, chunked a few
thousand samples per chunk. The manifest is written last, so a store whose creation was
interrupted is reported as missing rather than read half-filled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from jaxstream.stream.errors import StoreError, StoreNotFoundError
from jaxstream.stream.layout import KvSpec, make_context, open_array, open_kvstore, write_group

FORMAT = "jaxstream.datastore/1"
MANIFEST = "data.json"


class DataStore:
    """Samples by index: ``store.read(indices)`` -> dict of NumPy arrays.

    Example::

        ds = DataStore.create("/nvme/data", {"x": x, "y": y})
        batch = ds.read(np.arange(32))
    """

    def __init__(self, arrays: dict, num_samples: int):
        self._arrays, self.num_samples = arrays, num_samples

    @classmethod
    def create(cls, location: KvSpec, fields: Mapping[str, np.ndarray], *,
               chunk_samples: int = 4096, overwrite: bool = False) -> DataStore:
        """Writes ``fields`` (equal leading sample axis) and returns the open store."""
        if not fields:
            raise StoreError("fields must name at least one array, e.g. {'x': ..., 'y': ...}")
        sizes = {k: len(v) for k, v in fields.items()}
        if len(set(sizes.values())) != 1:
            raise StoreError(f"every field needs the same number of samples, got {sizes}")
        ctx = make_context()
        root = open_kvstore(location, ctx)
        if root.read(MANIFEST).result().state == "value":
            if not overwrite:
                raise StoreError(f"a data store already exists at {location}; pass overwrite=True")
            root.delete_range(ts_range_all()).result()
        n = next(iter(sizes.values()))
        meta = {"format": FORMAT, "num_samples": n, "fields": {}}
        write_group(root, "", {"jaxstream": {"format": FORMAT, "record": MANIFEST,
                                             "layout": "fields/NAME[sample, ...]"}})
        write_group(root, "fields")
        for k, v in fields.items():
            v = np.asarray(v)
            chunk = (max(1, min(chunk_samples, n)),) + v.shape[1:]
            arr = open_array(root, f"fields/{k}", ctx, create=True, shape=v.shape, chunk=chunk,
                             dtype=str(v.dtype),
                             attributes={"jaxstream": {"field": k, "dims": ["sample"] + [
                                 f"d{i}" for i in range(v.ndim - 1)]}})
            arr.write(v).result()
            meta["fields"][k] = {"shape": list(v.shape), "dtype": str(v.dtype)}
        root.write(MANIFEST, json.dumps(meta).encode()).result()
        return cls.open(location)

    @classmethod
    def open(cls, location: KvSpec) -> DataStore:
        """Opens an existing data store; raises StoreNotFoundError when there is none."""
        ctx = make_context()
        root = open_kvstore(location, ctx)
        res = root.read(MANIFEST).result()
        if res.state != "value":
            raise StoreNotFoundError(f"no data store at {location}: {MANIFEST} is missing")
        meta = json.loads(bytes(res.value))
        arrays = {k: open_array(root, f"fields/{k}", ctx) for k in meta["fields"]}
        return cls(arrays, int(meta["num_samples"]))

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self._arrays)

    def read(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Reads the samples at ``indices`` (any shape; the result keeps that leading shape)."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise StoreError(f"indices must be in [0, {self.num_samples}), got "
                             f"[{idx.min()}, {idx.max()}]")
        flat = idx.reshape(-1)
        futs = {k: a[flat].read() for k, a in self._arrays.items()}
        return {k: np.asarray(f.result()).reshape(idx.shape + tuple(a.shape[1:]))
                for (k, f), a in zip(futs.items(), self._arrays.values())}


def ts_range_all():
    """The whole key range of a kvstore (for overwrite)."""
    import tensorstore as ts

    return ts.KvStore.KeyRange()
