"""The exact part of a hybrid step: the group mean h of the selected micro-batches' gradients,
at the memory of one rematerialised backprop of the selection.

For a :class:`~jaxstream.models.Stack` one forward pass over the k selected micro-batches keeps
only each block's *input* (k·B activations per block, as ``jax.checkpoint`` per block would);
the reverse sweep then runs block by block, recomputing the block inside its vjp, and adds each
micro-batch's weight gradient with its group weight m_i(s) / |G_s| straight into h. No
micro-batch's whole gradient tree is ever materialised (``jax.vmap(jax.grad(...))`` keeps k of
them, plus every block's activations for the backward pass). For any other ``loss_fn`` the
selected micro-batches run one after another, each gradient added to h as it comes.

Example:
  >>> masks = corrections.group_masks(params, jnp.zeros((2,), jnp.int32))
  >>> h, counts, losses = group_exact_mean(stack, params, selected_batch, masks)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad.corrections import _bcast
from jaxstream.models.sequential import fold_rng
from jaxstream.models.stack import Stack, loss_dtype


def _weights(mask: jax.Array, count: jax.Array) -> jax.Array:
    """m_i / |G| (0 where the group is empty)."""
    return mask / jnp.maximum(count, 1.0)


def group_exact_mean(loss_fn: Callable, params: Any, batch: Any, masks: dict,
                     indices: jax.Array | None = None) -> tuple[Any, dict, jax.Array]:
    """(h, counts, losses): per segment, the mean exact gradient of the selected micro-batches
    in the segment's group (:func:`jaxstream.grad.corrections.group_masks`; 0 where it is
    empty), the groups' sizes, and the k micro-batches' losses.

    Args:
      loss_fn: a Stack or any ``loss_fn(params, micro_batch) -> scalar``.
      batch: the k selected micro-batches (leaves with a leading axis k).
      masks: per-segment membership of the k micro-batches.
      indices: the k micro-batches' places among the step's N (default 0..k-1): micro-batch n
        draws the model's randomness from ``fold_rng(loss_fn, n)``, as its forward pass does.
    """
    counts = {name: m.sum(axis=0) for name, m in masks.items()}
    if isinstance(loss_fn, Stack):
        h, losses = _stack_mean(loss_fn, params, batch, masks, counts)
        return h, counts, losses
    w = _weights(masks["tree"], counts["tree"])
    indices = jnp.arange(w.shape[0]) if indices is None else indices

    def body(acc, xs):
        b, wi, i = xs
        loss, g = jax.value_and_grad(fold_rng(loss_fn, i))(params, b)
        return jax.tree.map(lambda a, gg: a + (wi * gg).astype(a.dtype), acc, g), loss

    zero = jax.tree.map(jnp.zeros_like, params)
    h, losses = jax.lax.scan(body, zero, (batch, w, indices))
    return h, counts, losses


def _stack_mean(stack: Stack, params: dict, batch: dict, masks: dict,
                counts: dict) -> tuple[dict, jax.Array]:
    """One forward over the selection keeping block inputs, then a reverse sweep that adds
    each block's weighted weight gradient (see the module docstring); (h, losses)."""
    k = masks["head"].shape[0]
    h0, embed_vjp = jax.vjp(lambda p: jax.vmap(lambda x: stack.embed(p, x))(batch["x"]),
                            params["embed"])

    def forward(h, p):
        return jax.vmap(lambda hh: stack.block(p, hh))(h), h

    h_last, inputs = jax.lax.scan(forward, h0, params["blocks"])

    def head_losses(p, h):
        def one(hh, b):
            logits = stack.head(p, hh)
            return jnp.mean(stack.example_loss(logits.astype(loss_dtype(logits.dtype)), b))
        return jax.vmap(one)(h, batch)

    losses, head_vjp = jax.vjp(head_losses, params["head"], h_last)
    # The head's gradient is weighted by its group; the cotangent sent down is each
    # micro-batch's own (weight 1), weighted again per block.
    g_head = head_vjp(_weights(masks["head"], counts["head"]).astype(losses.dtype))[0]
    delta = head_vjp(jnp.ones((k,), losses.dtype))[1]

    def backward(dh, xs):
        p, h_in, m, c = xs
        _, vjp = jax.vjp(lambda pp, hh: jax.vmap(lambda h1: stack.block(pp, h1))(hh), p, h_in)
        w = _bcast(_weights(m, c), dh.ndim).astype(dh.dtype)
        return vjp(dh)[1], vjp(dh * w)[0]

    d0, g_blocks = jax.lax.scan(
        backward, delta, (params["blocks"], inputs, masks["blocks"].T, counts["blocks"]),
        reverse=True)
    w_embed = _bcast(_weights(masks["embed"], counts["embed"]), d0.ndim).astype(d0.dtype)
    (g_embed,) = embed_vjp(d0 * w_embed)
    return {"embed": g_embed, "blocks": g_blocks, "head": g_head}, losses
