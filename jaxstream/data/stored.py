"""A data set kept in TensorStore (a second store beside the layers): batches read per step.

:func:`write_data_store` writes a :class:`~jaxstream.data.digits.Dataset` as two
:class:`~jaxstream.stream.DataStore` s (``train/``, ``test/``) and its ``info.json``;
:func:`open_data_store` gives it back with the train split *streamed*: ``split["x"][idx]``
reads those samples from the store, so only the batches a run draws are read, and the
training loop prefetches the next step's batch in a thread while the current step runs
(:func:`batch_source`). The test split is small and is read whole. The batches are those of the
in-memory data set (the same indices of the same arrays), so a run on the store equals the run
on the data set it was written from.

Example::

    write_data_store(DigitsDataConfig().load(0), "/ssd2/digits")
    # experiment YAML:  data: {type: store, path: /ssd2/digits}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from jaxstream.data.batches import batch_at
from jaxstream.data.digits import Dataset
from jaxstream.stream.data_store import DataStore
from jaxstream.stream.errors import StoreNotFoundError

INFO = "info.json"


class StoredField:
    """One field of a stored split: ``len``, ``shape``, ``dtype``, and ``[idx]`` reads."""

    def __init__(self, array: Any):
        self._array = array
        self.shape = tuple(int(d) for d in array.shape)
        self.dtype = np.dtype(array.dtype.numpy_dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, idx: Any) -> np.ndarray:
        if isinstance(idx, (np.ndarray, list)):
            flat = np.asarray(idx, dtype=np.int64)
            out = np.asarray(self._array[flat.reshape(-1)].read().result())
            return out.reshape(flat.shape + self.shape[1:])
        return np.asarray(self._array[idx].read().result())

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.asarray(self._array.read().result())
        return out if dtype is None else out.astype(dtype)


class StoredSplit(Mapping):
    """A split whose fields are read from a :class:`DataStore` on demand (``streamed``)."""

    streamed = True

    def __init__(self, store: DataStore):
        self.store = store
        self._fields = {k: StoredField(a) for k, a in store._arrays.items()}

    def __getitem__(self, key: str) -> StoredField:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)


def write_data_store(data: Dataset, location: str | Path, *, chunk_samples: int = 1024,
                     overwrite: bool = False) -> None:
    """Write ``data``'s train and test splits and its info under ``location``."""
    root = Path(location)
    DataStore.create(str(root / "train"), data.train, chunk_samples=chunk_samples,
                     overwrite=overwrite)
    DataStore.create(str(root / "test"), data.test, chunk_samples=chunk_samples,
                     overwrite=overwrite)
    (root / INFO).write_text(json.dumps(dict(data.info)))


def open_data_store(location: str | Path) -> Dataset:
    """The data set under ``location``: train streamed from the store, test read whole.

    Raises:
      StoreNotFoundError: no data store (or no ``info.json``) there.
    """
    root = Path(location)
    if not (root / INFO).is_file():
        raise StoreNotFoundError(f"no data store at {root}: {INFO} is missing (write one with "
                                 "jaxstream.data.stored.write_data_store)")
    train = StoredSplit(DataStore.open(str(root / "train")))
    test_store = DataStore.open(str(root / "test"))
    test = test_store.read(np.arange(test_store.num_samples))
    return Dataset(train, test, json.loads((root / INFO).read_text()))


class _Prefetched:
    """``fn(step)`` with ``fn(step + 1)`` started in a thread as soon as ``step`` is asked for
    (a training loop asks for the steps in order; any other step is read in line)."""

    def __init__(self, fn: Callable[[int], dict]):
        self.fn = fn
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch")
        self._next: tuple[int, Future] | None = None

    def __call__(self, step: int) -> dict:
        if self._next is not None and self._next[0] == step:
            batch = self._next[1].result()
        else:
            batch = self.fn(step)
        self._next = (step + 1, self._pool.submit(self.fn, step + 1))
        return batch


def batch_source(data: Mapping, batch_size: int, seed: int) -> Callable[[int], dict]:
    """``step -> batch_at(data, batch_size, seed, step)``; a streamed split (read from a
    store) is prefetched one step ahead."""
    fn = lambda s: batch_at(data, batch_size, seed, s)
    return _Prefetched(fn) if getattr(data, "streamed", False) else fn
