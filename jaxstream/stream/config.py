"""The streamed executor's options, and the plans its sweeps run (checked by name)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxstream.grad.plan import Plan
from jaxstream.stream.depth import DepthPolicy

DTYPES = ("float32", "bfloat16", "float16")
UPDATES = ("eager", "lazy")
RESIDUALS = ("keep", "recompute")


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Options of the streamed executor.

    Attributes:
      prefetch: p, layers read ahead of the one computing (0: no overlap).
      compute_dtype: dtype of parameters and activations on the device ("float32",
        "bfloat16", "float16"); the master copy and the optimizer stay fp32.
      update: "eager" (update sweep after the step) or "lazy" (apply each layer's update when
        it is next read: the forward estimator's (key, scalars), a hybrid's deferred combine;
        a hybrid with ``replace`` updates in its reverse sweep either way).
      depth: which layers each step runs (:class:`DepthPolicy`).
      overlap_update: run each unit's host update and write beside the next unit's compute
        (``updates_in_flight`` of them); False runs it in line (the same values, for
        comparison).
      updates_in_flight: how many units' host work (update and write, in order on one
        worker thread) may be queued before the main thread waits for the oldest: 1 keeps
        one unit's update beside the compute; 2 lets the main thread dispatch on while the
        worker catches up (host memory: one unit's update more; the same values).
      stash_bytes: device bytes for the block inputs a reverse sweep stashes (None: no
        limit); beyond it they spill to host memory, asynchronously (one device).
      async_commit: write and fsync each step's manifest on a thread while the next step
        computes (:meth:`LayerStore.commit` with ``wait=False``); the next step's first write
        waits for it, a failed one is raised by the next step before anything is written, and
        a kill before it lands resumes at the step before. ``store.settle()`` (or
        ``store.close()``) waits for the last one. False: every step returns committed.
      rewrite_every: with ``update="lazy"``, k: a layer read with fewer than k forward
        records waiting uses them (replayed from their keys, bitwise the eager path's updates)
        without writing the layer back; the read that finds k records writes it and drops
        them. So a forward estimator's steady step reads each layer once and writes 1/k of
        them on average (1: every read writes). A hybrid's deferred combine is written at its
        next read either way (its carried means are not kept), and :meth:`flush` writes every
        layer (before an evaluation).
      layers_per_unit: G consecutive layers read, put on the device and run together as one
        scanned program (:class:`~jaxstream.stream.placement.Grouped`); the forward estimator
        with weight tangents and backprop only. 1: one layer per unit.
      residuals: "keep": backprop's forward sweep keeps each block's vjp residuals beside
        its stashed input (at most 4x the input more; counted in ``stash_bytes``), so the
        reverse sweep does not run the block's forward again (a dense block: 2 matmuls
        instead of 3; :mod:`jaxstream.stream.residuals`); a block whose residuals hold
        more than per-example arrays is recomputed. "recompute": stash the inputs only.
    """

    prefetch: int = 2
    compute_dtype: str = "bfloat16"
    update: str = "eager"
    depth: DepthPolicy = dataclasses.field(default_factory=DepthPolicy)
    overlap_update: bool = True
    updates_in_flight: int = 1
    stash_bytes: int | None = None
    async_commit: bool = False
    rewrite_every: int = 1
    layers_per_unit: int = 1
    residuals: str = "keep"

    def __post_init__(self):
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be one of {DTYPES}, got {self.compute_dtype!r}")
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        if self.residuals not in RESIDUALS:
            raise ValueError(f"residuals must be one of {RESIDUALS}, got {self.residuals!r}")
        for name in ("rewrite_every", "layers_per_unit", "updates_in_flight"):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        if self.rewrite_every > 1 and self.update != "lazy":
            raise ValueError(f"rewrite_every={self.rewrite_every} needs update='lazy' (an eager "
                             f"update writes every layer it updates), got "
                             f"update={self.update!r}")
        if self.stash_bytes is not None and (not isinstance(self.stash_bytes, int)
                                             or self.stash_bytes < 0):
            raise ValueError(f"stash_bytes must be None or an int >= 0, got {self.stash_bytes!r}")



def plan_of(estimator: Any, update: str = "eager", engine: str = "stream") -> Plan:
    """The estimator's plan, checked against what the streamed sweeps run; errors name it and
    the ``engine`` ("stream" or "composed")."""
    plan = getattr(estimator, "plan", None)
    if not isinstance(plan, Plan):
        raise TypeError(f"{engine}: estimator must be a jaxstream.grad estimator (one with a "
                        f".plan), got {type(estimator).__name__}")
    fp = plan.forward_pass
    fp.refuse_unless(engine, engine, plan.describe())
    if plan.mixes and not fp.scalars:
        raise TypeError(f"{engine}: estimator must be one that mixes exact gradients with weight "
                        f"tangents; got "
                        f"{type(estimator).__name__}, {plan.describe()}, which mixes them with "
                        f"a {plan.forward!r} forward pass (run it in memory or data parallel)")
    # lazy: the forward estimate's and a hybrid's update wait for the layer's next read;
    # backprop and exact subsets update in their reverse sweep either way (nothing to defer)
    if update == "lazy" and not (not fp.runs or (
            fp.scalars and (plan.exact == "none" or plan.mixes))):
        raise ValueError(f"{engine}: update='lazy' needs the forward estimator with "
                         f"perturb='weights', a hybrid (an update described by keys, scalars "
                         f"and the hybrid's exact means) or backprop (updated in its reverse "
                         f"sweep either way), got {plan.describe()}")
    return plan
