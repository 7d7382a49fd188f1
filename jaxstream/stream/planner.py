"""Planner: the batch size at which compute hides the reads of a streamed step.

Cost model (one layer): P parameter bytes read at W bytes/s take P/W; a batch of b samples
with f FLOPs per sample through the layer takes b·f/R at R FLOP/s. With prefetching the two
overlap, so a layer costs max(b·f/R, P/W) and I/O is hidden when b >= P·R / (f·W). Device
memory holds (p + 1) layers in the compute dtype plus the activations of the batch (and
their tangents). A step of L layers takes about L·max(b·f/R, P/W) for the forward sweep,
plus an update sweep for eager forward gradients (another read and a write per layer).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LayerCost(NamedTuple):
    """Per-layer facts of a model: fp32 parameter bytes, FLOPs and activation bytes per sample."""

    param_bytes: int
    flops_per_sample: float
    activation_bytes_per_sample: int
    num_layers: int


class Plan(NamedTuple):
    """The planner's answer (all times in seconds, sizes in bytes)."""

    min_batch: int              # smallest batch whose compute hides the layer read
    batch: int                  # the batch planned (>= min_batch unless memory forbids)
    read_time_per_layer: float  # P / W
    compute_time_per_layer: float  # batch · f / R
    step_time: float            # predicted streamed step time
    io_bound: bool              # True when even the largest batch that fits cannot hide I/O
    activation_bytes: int       # activations (+ tangents) of the batch on the device
    device_bytes: int           # (p + 1) layers + activations
    needed_bandwidth: float     # bytes/s the planned batch needs to stay compute-bound


def layer_cost(stack: Any, params: Any, sample: Any, *, tangents: int = 1) -> LayerCost:
    """Measures a stack's per-layer cost with XLA's cost analysis of one block.

    Args:
      stack: the model; params: its parameters; sample: one input batch {"x": (b, ...)}.
      tangents: K, tangents carried with the primal (the jvp pass costs about 1 + 2K forwards).
    """
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), params["blocks"])
    h = jax.eval_shape(stack.embed, params["embed"], sample["x"])
    b = h.shape[0]
    fn = jax.jit(stack.block).lower(layer, jax.ShapeDtypeStruct(h.shape, h.dtype))
    cost = fn.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = float(cost.get("flops", 0.0)) / b * (1 + 2 * tangents)
    act = int(np.prod(h.shape[1:])) * jnp.dtype(h.dtype).itemsize * (1 + tangents)
    pbytes = sum(int(np.prod(a.shape[1:])) * 4 for a in jax.tree.leaves(params["blocks"]))
    return LayerCost(pbytes, flops, act, stack.num_layers)


def plan(cost: LayerCost, *, device_flops: float, read_bandwidth: float, device_memory: float,
         prefetch: int = 2, compute_bytes: int = 2, write_bandwidth: float | None = None,
         update_sweep: bool = False, batch: int | None = None) -> Plan:
    """Picks the smallest batch for which compute hides I/O, within device memory.

    Args:
      cost: :func:`layer_cost` (or measured numbers).
      device_flops: R, achieved device FLOP/s.
      read_bandwidth: W, measured store read bandwidth (bytes/s).
      device_memory: bytes available on the device.
      prefetch: p, layers in flight.
      compute_bytes: bytes per parameter on the device (2 for bf16, 4 for fp32).
      write_bandwidth: store write bandwidth (default: read_bandwidth); used with update_sweep.
      update_sweep: add the eager update sweep (read + write of every layer).
      batch: evaluate this batch instead of the planned one.
    Raises:
      ValueError: a non-positive input (named), or (p + 1) layers alone exceed device memory.
    """
    for name, v in (("device_flops", device_flops), ("read_bandwidth", read_bandwidth),
                    ("device_memory", device_memory), ("param_bytes", cost.param_bytes),
                    ("flops_per_sample", cost.flops_per_sample)):
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v!r}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    p_bytes, f, r, w = cost.param_bytes, cost.flops_per_sample, device_flops, read_bandwidth
    layers_on_device = (prefetch + 1) * (p_bytes // 4) * compute_bytes
    if layers_on_device >= device_memory:
        fix = "lower prefetch, " if prefetch > 0 else ""
        raise ValueError(f"device_memory={device_memory:.3g} B cannot hold "
                         f"prefetch+1={prefetch + 1} layers of {p_bytes // 4 * compute_bytes} B; "
                         f"{fix}use a smaller layer or a device with more memory")
    min_batch = max(1, math.ceil(p_bytes * r / (f * w)))
    max_batch = int((device_memory - layers_on_device) // max(cost.activation_bytes_per_sample, 1))
    b = batch if batch is not None else min(min_batch, max_batch)
    if b < 1:
        raise ValueError("device_memory leaves no room for a single sample's activations")
    t_read, t_comp = p_bytes / w, b * f / r
    per_layer = max(t_read, t_comp)
    step = cost.num_layers * per_layer
    if update_sweep:
        ww = write_bandwidth or w
        step += cost.num_layers * (t_read + p_bytes / ww)
    act = b * cost.activation_bytes_per_sample
    return Plan(min_batch, b, t_read, t_comp, step, min_batch > max_batch, act,
                layers_on_device + act, p_bytes / max(t_comp, 1e-30))


def format_plan(cost: LayerCost, p: Plan) -> str:
    """A human-readable table of a plan."""
    rows = [
        ("layers", f"{cost.num_layers}"),
        ("bytes per layer (fp32)", f"{cost.param_bytes / 2**20:.2f} MiB"),
        ("FLOPs per sample per layer", f"{cost.flops_per_sample:.3g}"),
        ("smallest batch hiding I/O", f"{p.min_batch}"),
        ("planned batch", f"{p.batch}" + ("  (I/O-bound: memory caps the batch)" if p.io_bound else "")),
        ("read time per layer", f"{p.read_time_per_layer * 1e3:.3f} ms"),
        ("compute time per layer", f"{p.compute_time_per_layer * 1e3:.3f} ms"),
        ("activation memory", f"{p.activation_bytes / 2**20:.2f} MiB"),
        ("device memory used", f"{p.device_bytes / 2**20:.2f} MiB"),
        ("bandwidth the batch needs", f"{p.needed_bandwidth / 1e9:.3f} GB/s"),
        ("predicted step time", f"{p.step_time * 1e3:.2f} ms"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
