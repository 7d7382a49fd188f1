"""Pipeline stages of unequal size: stage s holds ``sizes[s]`` consecutive blocks.

The pipeline executor runs M stages of equal shape under one ``shard_map``; unequal stages are
made equal by padding every stage to the largest with *skipped* blocks. :func:`unequal_stages`
returns the padded model and the maps of parameters in and gradients out: a padded block
carries ``{"block": params, "on": 1.0 or 0.0}`` and runs ``lax.cond(on, block, identity)``,
so a skipped block computes nothing (the branch not taken is not run) and passes its input
through; its gradient is dropped when the gradients come back. The padded model computes the
same function and, for backprop, the same gradient as the original (tested against ``jax.grad``
of the sequential model).

Place the split with :func:`jaxstream.placement.place_stages` (measured layer costs, device
speeds) or :func:`jaxstream.placement.place_by_type` (device kinds × layer types).

What the padding changes: tangents are drawn per padded block and per leaf of the padded
tree, so a forward estimate on the padded pipeline equals the in-memory estimator run on the
*padded* model (same key), not on the original; and every stage holds ``max(sizes)`` blocks of
parameters (the skipped ones are zeros).

Example:
  >>> plan = place_stages(layer_costs, device_speeds=(1, 1, 2, 4))
  >>> padded, pad, unpad = unequal_stages(stack, plan.sizes)
  >>> loss, g = pipeline(padded, gpipe_backprop(4, 8), backprop())(pad(params), micro, key)[:2]
  >>> grads = unpad(g)                     # shaped like params
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.models.stack import Stack

LAYOUTS = ("contiguous", "chunked")


def _layout(sizes: Sequence[int], num_layers: int, layout: str = "contiguous") -> np.ndarray:
    """The padded model's slots in order: the layer each runs, −1 for a skipped slot.

    ``contiguous`` (the pipeline: stage s holds padded slots s·P … s·P + P − 1) puts stage
    s's ``sizes[s]`` layers first in its P slots. ``chunked`` (the composed engine: padded
    slot c·M + s runs on stage s in chunk c) fills chunk by chunk, stage s taking a layer in
    chunks 0 … sizes[s] − 1, in model order."""
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) < 1 or sum(sizes) != num_layers:
        raise ValueError(f"sizes: one positive number of blocks per stage, summing to the "
                         f"model's {num_layers} blocks; got {tuple(sizes)}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r}; allowed: {LAYOUTS}")
    width = max(sizes)
    out = np.full((len(sizes), width), -1, np.int64)
    if layout == "contiguous":
        start = 0
        for s, n in enumerate(sizes):
            out[s, :n] = np.arange(start, start + n)
            start += n
        return out.ravel()
    layer = 0
    for c in range(width):
        for s, n in enumerate(sizes):
            if c < n:
                out[s, c] = layer
                layer += 1
    return out.T.ravel()  # slot c·M + s


def unequal_stages(stack: Stack, sizes: Sequence[int],
                   layout: str = "contiguous") -> tuple[Stack, Callable, Callable]:
    """``(padded stack, pad(params), unpad(grads))`` for stages of ``sizes`` blocks.

    ``layout``: ``"contiguous"`` for :func:`~jaxstream.pipeline.pipeline` (a stage holds
    consecutive slots), ``"chunked"`` for :class:`~jaxstream.compose.ComposedExecutor` (slot
    c·M + s runs on stage s; store ``pad(params)`` in its layer store).

    Raises:
      ValueError: ``sizes`` not positive or not summing to ``stack.num_layers``; an unknown
        ``layout``.
    """
    slots = _layout(sizes, stack.num_layers, layout)
    on = slots >= 0
    take = np.where(on, slots, 0)
    back = np.array([int(np.nonzero(slots == l)[0][0]) for l in range(stack.num_layers)])

    def block(p, h):
        return jax.lax.cond(p["on"] > 0, lambda: stack.block(p["block"], h), lambda: h)

    def pad(params: dict) -> dict:
        blocks = jax.tree.map(lambda a: jnp.where(
            jnp.asarray(on).reshape((-1,) + (1,) * (jnp.ndim(a) - 1)), jnp.asarray(a)[take],
            jnp.zeros((), jnp.asarray(a).dtype)), params["blocks"])
        return {**params, "blocks": {"block": blocks,
                                     "on": jnp.asarray(on, jnp.float32)}}

    def unpad(grads: dict) -> dict:
        return {**grads, "blocks": jax.tree.map(lambda a: jnp.asarray(a)[back],
                                                grads["blocks"]["block"])}

    def init(key: jax.Array) -> dict:
        return pad(stack.init(key))

    padded = dataclasses.replace(stack, block=block, init=init, num_layers=int(slots.size),
                                 name=f"{stack.name}|stages{tuple(int(s) for s in sizes)}")
    return padded, pad, unpad
