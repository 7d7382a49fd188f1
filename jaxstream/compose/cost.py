"""The composed engine's cost model: ticks, bytes read and memory of one step.

With L layers in the step cut into C = L / M chunks (M stages), N micro-batches of B examples
split over D replicas, S of them selected for exact gradients and p chunks prefetched:

* a chunk pass takes N + M − 1 ticks (each stage busy N of them); a reverse pass over the S
  selected micro-batches S + M − 1;
* the sweeps of a step (forward, reverse, update, ...) each read every layer once from the
  store (the update sweep of a forward estimate and the control variate's third sweep are
  host-only: no ticks);
* a device holds p + 1 layers (its stage's layer of the computing chunk and of the prefetched
  ones) plus the embed and head, never the model;
* activations on a device: the N micro-batches' states of the running pass (primal and K
  tangents, B / D examples each); the host stashes the S selected micro-batches' input to
  every layer (S · L · B activations) for the reverse sweep.

Example:
  >>> c = chunk_cost("hybrid_cv", layers=8, stages=4, micro_batches=8, selected=2)
  >>> c.ticks, c.layer_reads
  (32, 24)
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class ChunkCost:
    """Predicted cost of one step (see the module docstring)."""

    ticks: int
    bubble_fraction: float
    layer_reads: int
    resident_layers_per_device: int
    stash_activations: int  # micro-batch activations (B examples each) stashed on the host


def chunk_cost(kind: str, *, layers: int, stages: int, micro_batches: int, selected: int = 0,
               prefetch: int = 2) -> ChunkCost:
    """The step's cost under the chunked schedule; ``kind`` is a key of :data:`SWEEPS`
    (``weighted`` and ``stein`` cost as ``hybrid_cv``)."""
    if kind not in SWEEPS:
        raise ValueError(f"kind must be one of {sorted(SWEEPS)}, got {kind!r}")
    if layers % stages:
        raise ValueError(f"stages = {stages} must divide layers = {layers}")
    c, m = layers // stages, stages
    fwd, rev, host = SWEEPS[kind]
    n = 1 if kind in ("activity", "local") else micro_batches
    s = micro_batches if kind == "backprop" else selected
    ticks = c * (fwd * (n + m - 1) + rev * (s + m - 1))
    busy = c * (fwd * n + rev * s)
    return ChunkCost(ticks=ticks, bubble_fraction=1.0 - busy / ticks if ticks else 0.0,
                     layer_reads=layers * (fwd + rev + host),
                     resident_layers_per_device=prefetch + 1,
                     stash_activations=(s * layers if rev else 0))
