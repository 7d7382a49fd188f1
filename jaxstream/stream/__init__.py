"""Layer streaming: parameters in a TensorStore, executed layer by layer on the device."""

from jaxstream.stream.data_store import DataStore
from jaxstream.stream.depth import DepthPolicy
from jaxstream.stream.errors import (
    StoreCorruptError,
    StoreDivergedError,
    StoreError,
    StoreLockedError,
    StoreMismatchError,
    StoreNonFiniteError,
    StoreNotCommittedError,
    StoreNotFoundError,
    StoreReadError,
    StoreStaleError,
    StoreWriteError,
)
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from jaxstream.stream.placement import OneDevice, Placement
from jaxstream.stream.planner import LayerCost, Plan, layer_cost, plan
from jaxstream.stream.store import LayerStore, TreeFuture

__all__ = [
    "DataStore",
    "DepthPolicy",
    "LayerCost",
    "LayerStore",
    "OneDevice",
    "Placement",
    "Plan",
    "StoreCorruptError",
    "StoreDivergedError",
    "StoreError",
    "StoreLockedError",
    "StoreMismatchError",
    "StoreNonFiniteError",
    "StoreNotCommittedError",
    "StoreNotFoundError",
    "StoreReadError",
    "StoreStaleError",
    "StoreWriteError",
    "StreamConfig",
    "StreamedExecutor",
    "TreeFuture",
    "layer_cost",
    "plan",
]
