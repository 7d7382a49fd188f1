"""A hybrid's combine, deferred to the layer's next read.

A control-variate, ``weighted`` or ``stein`` hybrid forms each unit's estimate from its group
mean h_u of the selected micro-batches' exact gradients and from step-wide scalars: the
micro-batches' directional derivatives d (N, K), the cross-unit ``totals`` (c_nk), the
selection and its nested groups. The totals are complete only when the reverse sweep has
passed every unit, so an eager update needs a third sweep over the layers. Deferred, the
step commits one :class:`Combine` record per unit (the scalars, and the carry slot of the
store where h_u was written with its crc32c) and the update is applied when the layer is next
read (:meth:`jaxstream.stream.StreamedExecutor.step` with ``update="lazy"``), from the same
inputs as the eager update and so to the same values.

Example::

    c = Combine.of(rule="control_variate", key=key, n=8, d=d, totals={"c": c_nk},
                   idx=idx, depth=depth, total_size=1234.0)
    rec = c.encode(slot=1, crcs=[...])          # JSON, committed in the store's manifest
    assert Combine.decode(rec).member(3).shape == (len(idx),)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

LayerKey = str | int


def _arr(a: Any) -> dict:
    a = np.asarray(a)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "values": a.ravel().tolist()}


def _unarr(rec: dict) -> np.ndarray:
    return np.asarray(rec["values"], rec["dtype"]).reshape(rec["shape"])


@dataclasses.dataclass(frozen=True)
class Combine:
    """What one step's combine rule needs besides a unit's params and its h_u.

    Attributes:
      rule: the combine rule's name (a record is applied only by an estimator with that rule).
      key_data, impl: the step's key (raw uint32 data and PRNG implementation).
      n: micro-batches in the step.
      d: (N, K) directional derivatives ((N, 1) along a direction).
      totals: the rule's cross-unit sums (name → array).
      idx: the selected micro-batches; depth: the first layer each one's exact gradient reaches.
      total_size: the model's parameter count (float32).
      scale: along a direction, u_unit = h_u · scale; else None.
    """

    rule: str
    key_data: np.ndarray
    impl: str
    n: int
    d: np.ndarray
    totals: dict
    idx: np.ndarray
    depth: np.ndarray
    total_size: np.float32
    scale: float | None = None

    @classmethod
    def of(cls, *, rule: str, key: jax.Array, n: int, d: Any, totals: dict, idx: Any,
           depth: Any, total_size: float, scale: float | None = None,
           key_data: np.ndarray | None = None) -> Combine:
        """``key_data``: the key's raw data if already read (else read here)."""
        data = jax.random.key_data(key) if key_data is None else key_data
        return cls(rule, np.asarray(data, np.uint32),
                   str(jax.random.key_impl(key)), int(n), np.asarray(d, np.float32),
                   {k: np.asarray(v) for k, v in totals.items()}, np.asarray(idx, np.int32),
                   np.asarray(depth, np.int32), np.float32(total_size),
                   None if scale is None else float(scale))

    # ------------------------------------------------------------------ what the rule reads
    @functools.cached_property
    def keys(self) -> jax.Array:
        """The micro-batches' keys (N,), as the step drew its tangents (drawn once per
        record, not once per unit)."""
        from jaxstream.stream.kernels import micro_keys

        return micro_keys(jax.random.wrap_key_data(self.key_data, impl=self.impl), self.n)

    def member(self, unit: LayerKey) -> np.ndarray:
        """Which selected micro-batches have ``unit``'s exact gradient (nested groups: the
        head's group holds every one, block l those of depth ≤ l, the embed depth ≤ 0)."""
        if unit == "head":
            return np.ones(self.depth.shape, np.float32)
        return (self.depth <= (0 if unit == "embed" else int(unit))).astype(np.float32)

    def common(self) -> dict:
        """The statistics every unit shares: the selection, the micro-batches outside it, the
        model's size."""
        outside = np.ones(self.n, np.float32)
        outside[self.idx] = 0.0
        return {"idx": np.asarray(self.idx, np.int32), "outside": outside,
                "total_size": np.float32(self.total_size)}  # NumPy: a jitted kernel's arguments

    # ------------------------------------------------------------------ JSON
    def encode(self, slot: int, crcs: list[int]) -> dict:
        """The record of one unit: these scalars and the carry ``slot`` holding its h_u, whose
        leaves have crc32c ``crcs`` (float32 values round-trip exactly)."""
        return {"combine": self.rule, "key": self.key_data.tolist(), "impl": self.impl,
                "n": self.n, "d": _arr(self.d),
                "totals": {k: _arr(v) for k, v in self.totals.items()},
                "idx": self.idx.tolist(), "depth": self.depth.tolist(),
                "total_size": float(self.total_size), "scale": self.scale,
                "slot": int(slot), "crc": [int(c) for c in crcs]}

    @classmethod
    def decode(cls, rec: dict) -> Combine:
        """Inverse of :meth:`encode` (the slot and crcs stay in ``rec``)."""
        return cls(rec["combine"], np.asarray(rec["key"], np.uint32), rec["impl"], int(rec["n"]),
                   _unarr(rec["d"]), {k: _unarr(v) for k, v in rec["totals"].items()},
                   np.asarray(rec["idx"], np.int32), np.asarray(rec["depth"], np.int32),
                   np.float32(rec["total_size"]), rec["scale"])


def is_combine(rec: dict) -> bool:
    """Whether a pending record is a deferred combine (else a forward estimate's)."""
    return "combine" in rec


def carry_slot(pending: dict, unit: LayerKey) -> int:
    """The carry slot a new record of ``unit`` writes: the one its committed record (if any)
    does not name, so a failed or killed step leaves the committed record's values intact."""
    recs = [r for r in pending.get(str(unit), []) if is_combine(r)]
    return 1 - int(recs[-1]["slot"]) if recs else 0
