"""The composed engine's cost model: ticks, bytes read and memory of one step.

With L layers in the step cut into C = L / M chunks (M stages), N micro-batches of B examples
split over D replicas, S of them selected for exact gradients and p chunks prefetched:

* circular schedule (the default, :mod:`.circular`): a sweep of n chains (N micro-batches
  forward, S selected ones in reverse) takes C·P + max(0, n + M − 1 − P) ticks with period
  P = max(n, M): one fill and one drain per sweep, so S ≤ M reverse chains cost L + S − 1 ticks;
* chunked schedule (one GPipe pass per chunk, :mod:`.pipe`): C (n + M − 1) ticks per sweep;
* the sweeps of a step (forward, reverse, update, ...) each read every layer once from the
  store (the update sweep of a forward estimate and the control variate's third sweep are
  host-only: no ticks), except the reverse sweep, which starts on the forward sweep's last
  chunk, still resident (M layers fewer); with ``update="lazy"`` the update sweep is gone: each
  layer's update is applied when it is next read (a control-variate hybrid reads 2 L − M
  layers per step);
* a device holds its stage's layer of the running chunk and of the p prefetched ones, and in
  the circular schedule also of the previous chunk (still draining): p + 2 layers (chunked:
  p + 1), plus the embed and head, never the model;
* activations on a device: the N micro-batches' states of the running pass (primal and K
  tangents, B / D examples each); the host stashes the S selected micro-batches' input to
  every layer (S · L · B activations) for the reverse sweep.

Example:
  >>> c = chunk_cost("hybrid_cv", layers=8, stages=4, micro_batches=8, selected=2)
  >>> c.ticks, c.layer_reads
  (28, 20)
  >>> chunk_cost("hybrid_cv", layers=8, stages=4, micro_batches=8, selected=2,
  ...            update="lazy").layer_reads
  12
  >>> chunk_cost("hybrid_cv", layers=8, stages=4, micro_batches=8, selected=2,
  ...            schedule="chunked").ticks
  32
"""

from __future__ import annotations

import dataclasses

from jaxstream.compose.circular import circular_ticks

#: Per estimator kind: (sweeps with a forward chunk pass, reverse passes, host-only sweeps that
#: read every layer). Activity perturbation computes its N micro-batches as one.
SWEEPS = {
    "forward": (1, 0, 1),        # forward sweep; update sweep (host)
    "forward_lazy": (1, 0, 0),   # the update is applied when the layer is next read
    "activity": (2, 0, 0),       # forward sweep; update sweep recomputing each layer (vjp)
    "local": (1, 0, 0),          # one sweep: each layer's estimate from its own loss
    "backprop": (1, 1, 0),       # forward (stash), reverse with every micro-batch
    "hybrid_replace": (1, 1, 0),
    "hybrid_cv": (1, 1, 1),      # + an update sweep once c_nk is complete
    "hybrid_guess": (2, 1, 1),   # + a forward sweep along the exact direction, update sweep
}
#: What ``update="lazy"`` makes of a kind: its update sweep deferred to the next read.
LAZY = {"forward": "forward_lazy", "hybrid_cv": "hybrid_cv_lazy",
        "hybrid_guess": "hybrid_guess_lazy"}
SWEEPS.update({"hybrid_cv_lazy": (1, 1, 0), "hybrid_guess_lazy": (2, 1, 0)})
UPDATES = ("eager", "lazy")


@dataclasses.dataclass(frozen=True)
class ChunkCost:
    """Predicted cost of one step (see the module docstring)."""

    ticks: int
    bubble_fraction: float
    layer_reads: int
    resident_layers_per_device: int
    stash_activations: int  # micro-batch activations (B examples each) stashed on the host


def sweep_ticks(chains: int, stages: int, chunks: int, schedule: str = "circular") -> int:
    """Ticks of one sweep of ``chains`` chains through ``chunks`` chunks of ``stages`` layers."""
    if schedule == "chunked":
        return chunks * (chains + stages - 1)
    return circular_ticks(chains, stages, chunks)[1]


def chunk_cost(kind: str, *, layers: int, stages: int, micro_batches: int, selected: int = 0,
               prefetch: int = 2, schedule: str = "circular", update: str = "eager") -> ChunkCost:
    """The step's cost; ``kind`` is a key of :data:`SWEEPS` (``weighted`` and ``stein`` cost
    as ``hybrid_cv``), ``schedule`` "circular" or "chunked", ``update`` "eager" or "lazy"
    (the update deferred to the layer's next read; kinds without an update sweep are
    unchanged)."""
    if kind not in SWEEPS:
        raise ValueError(f"kind must be one of {sorted(SWEEPS)}, got {kind!r}")
    if update not in UPDATES:
        raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
    if update == "lazy":
        kind = LAZY.get(kind, kind)
    if schedule not in ("circular", "chunked"):
        raise ValueError(f"schedule must be one of ('circular', 'chunked'), got {schedule!r}")
    if layers % stages:
        raise ValueError(f"stages = {stages} must divide layers = {layers}")
    c, m = layers // stages, stages
    fwd, rev, host = SWEEPS[kind]
    n = 1 if kind in ("activity", "local") else micro_batches
    s = micro_batches if kind == "backprop" else selected
    ticks = (fwd * sweep_ticks(n, m, c, schedule)
             + rev * (sweep_ticks(s, m, c, schedule) if s else 0))
    busy = c * (fwd * n + rev * s)
    return ChunkCost(ticks=ticks, bubble_fraction=1.0 - busy / ticks if ticks else 0.0,
                     layer_reads=layers * (fwd + rev + host) - (m if rev else 0),
                     resident_layers_per_device=prefetch + (2 if schedule == "circular" else 1),
                     stash_activations=(s * layers if rev else 0))
