"""Layer streaming: parameters in a TensorStore, executed layer by layer on the device."""

from jaxstream.stream.data_store import DataStore
from jaxstream.stream.errors import (
    StoreError,
    StoreMismatchError,
    StoreNotFoundError,
    StoreWriteError,
)
from jaxstream.stream.store import LayerStore, TreeFuture

__all__ = [
    "DataStore",
    "LayerStore",
    "StoreError",
    "StoreMismatchError",
    "StoreNotFoundError",
    "StoreWriteError",
    "TreeFuture",
]
