"""A stack whose embed and blocks each carry their own local head (Ren et al., ICLR 2023).

Local losses (``forward(perturb="activations", local_losses=True)``, LG-FG-A, and
``local_forward_weights``, LG-FG-W) apply, by default, the model's final head to every block's
output, held fixed: a *shared-head* design. Ren et al. instead give every block a head of its
own, learned by the exact gradient of its local loss. :func:`with_local_heads` builds that
model from any stack: ``params["embed"]`` and ``params["blocks"]`` become
``{"module": ..., "local_head": ...}``, each local head shaped as the final head and
initialised afresh. The model's output and loss are unchanged (local heads are read by local
losses only), so every other estimator trains it as before; its local heads then get zero
gradient (backprop) or zero-mean noise (weight perturbation).

``groups=G`` (Ren et al.'s M/1/G setting): every segment's output features split into G
groups, each with a loss of its own: the output is averaged over its positions (a CNN's pixels,
a sequence's tokens), group ``g``'s features classified by a linear head of its own, and the
segment's local loss is the mean of the G group losses. An activity tangent on group ``g``
then reaches only group ``g``'s loss (:func:`jaxstream.grad.segments.local_grad`), so the
estimate is G separate local problems, less noisy than one loss over all features.

``patch_groups=P`` splits the positions of a (batch, tokens, features) output as well: P × G
cells, each with a loss (Ren et al.'s LocalMixer losses, patch-wise and group-wise at once;
:func:`jaxstream.models.local_mixer` keeps its channel groups apart). With a head per cell each
cell is classified from its own features; with ``aggregate=True`` (Ren et al.'s feature
aggregator, the design of their released code) one head per segment reads the whole output and
each cell's loss is that head's loss with the other cells held fixed.

Example:
  >>> stack = with_local_heads(mlp(in_dim=40, width=100, depth=1, num_classes=10))
  >>> params = stack.init(jax.random.key(0))
  >>> loss, grads = forward(perturb="activations", local_losses=True)(stack, params, batch, key)
  >>> grouped = with_local_heads(mlp(40, 128, 1, 10), groups=16, x=batch["x"])   # M/1/16
  >>> cells = with_local_heads(local_mixer(groups=4), groups=4, patch_groups=16,
  ...                          x=batch["x"], aggregate=True)   # 64 cells per block
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.models.stack import Stack

LOCAL = 0x10CA1  # key segment of the local heads' initialisation


def with_local_heads(stack: Stack, groups: int = 1, x: Any = None,
                     over: str = "features", patch_groups: int = 1,
                     aggregate: bool = False) -> Stack:
    """``stack`` with a local head of the final head's shape on the embed and on every block;
    ``groups`` > 1: G linear heads per segment, one per group of its output features (``x``,
    a few inputs, gives the features' and the classes' sizes), or with ``over="positions"``
    one per group of its positions (tokens, patches: an output (B, T, D), T split into G
    contiguous groups, each head reading its group's mean features; Ren et al.'s patch-wise
    losses). ``patch_groups`` > 1 splits the positions too: P × G cells, each with a loss of
    its own (Ren et al.'s LocalMixer losses, patch-wise and group-wise at once).

    ``aggregate=True`` is Ren et al.'s feature aggregator: one head per segment, of the final
    head's shape, reads the segment's whole output; cell c's loss is that head's loss with
    every other cell held fixed (``stop_gradient``), its own part scaled by the number of cells
    C. Every cell's loss then has the same value, the local head's exact gradient is that of
    the one loss ℓ, and an activity tangent on cell c reaches only cell c's loss: the estimate
    Σ_c (∇_c ℓ · u_c) u_c is unbiased for ∇ℓ with C independent directional derivatives.

    Example:
      >>> cells = with_local_heads(local_mixer(groups=4), groups=4, patch_groups=16,
      ...                          x=x[:2], aggregate=True)   # 64 cells per block

    Raises:
      ValueError: ``stack`` already has local heads, or its head does not read every block's
        output (a padded stack); with groups: no ``x``, a width G does not divide, or a head
        that does not classify a whole example (per-token logits).
    """
    if not isinstance(stack, Stack):
        raise TypeError(f"with_local_heads: needs a model Stack, got {type(stack).__name__}")
    if stack.local_head is not None:
        raise ValueError(f"with_local_heads: {stack.name!r} already has local heads")
    if not stack.shared_head:
        raise ValueError(f"with_local_heads: {stack.name!r}'s head reads only the last block's "
                         "output (a padded stack), so a head of its shape cannot read the others")
    for name, value in (("groups", groups), ("patch_groups", patch_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    if over not in ("features", "positions"):
        raise ValueError(f"over: must be 'features' or 'positions', got {over!r}")
    if not isinstance(aggregate, bool):
        raise TypeError(f"aggregate: must be true or false, got {aggregate!r}")
    if over == "positions":
        if patch_groups > 1:
            raise ValueError("patch_groups: over='positions' already splits the positions into "
                             "`groups`; give the feature groups as `groups` with "
                             "over='features' and the position groups as patch_groups")
        groups, patch_groups = 1, groups
    if groups * patch_groups > 1:
        return _cells(stack, patch_groups, groups, x, aggregate)
    if aggregate:
        raise ValueError("aggregate: the feature aggregator splits a segment's output into "
                         "cells; with groups = patch_groups = 1 there is one (use the default)")
    return _with_local(stack, _final_heads(stack), stack.head, "")


def _final_heads(stack: Stack):
    """Initialiser of a stack of fresh heads shaped as the final head (keys → params)."""
    return jax.jit(jax.vmap(lambda k: stack.init(k)["head"]))


def _with_local(stack: Stack, heads: Any, local_head: Any, kind: str,
                cells: tuple = (), count: int = 1) -> Stack:
    """``stack`` whose embed and blocks carry local heads initialised by ``heads`` (keys →
    params, one key per segment) and read by ``local_head``."""

    def init(key: jax.Array) -> dict:
        own = heads(jax.random.split(jax.random.fold_in(key, LOCAL), stack.num_layers + 1))
        return _with_heads(stack.init(key), own)

    return dataclasses.replace(
        stack, embed=lambda p, x: stack.embed(p["module"], x),
        block=lambda p, h: stack.block(p["module"], h), init=init, local_head=local_head,
        local_groups=count, local_cells=cells,
        name=f"{stack.name}+local heads" + (f"/{kind}" if kind else ""))


def _with_heads(params: dict, own: Any) -> dict:
    """``params`` with local heads ``own`` (a leading axis: the embed's, then each block's)."""
    first = jax.tree.map(lambda a: a[0], own)
    rest = jax.tree.map(lambda a: a[1:], own)
    return {"embed": {"module": params["embed"], "local_head": first},
            "blocks": {"module": params["blocks"], "local_head": rest},
            "head": params["head"]}


def _cells(stack: Stack, patches: int, groups: int, x: Any, aggregate: bool) -> Stack:
    """The P × G cells case of :func:`with_local_heads`: ``patches`` contiguous groups of the
    positions (axis 1) times ``groups`` of the features (the last axis)."""
    if x is None:
        raise ValueError("with_local_heads: groups > 1 needs x= (a few inputs) for the sizes of "
                         "the features and the classes")
    p = jax.eval_shape(stack.init, jax.random.key(0))
    h = jax.eval_shape(stack.embed, p["embed"], jnp.asarray(x))
    out = jax.eval_shape(lambda b, hh: stack.block(jax.tree.map(lambda a: a[0], b), hh),
                         p["blocks"], h)
    logits = jax.eval_shape(stack.head, p["head"], out)
    if len(logits.shape) != 2:
        raise ValueError(f"groups: grouped local losses classify each example from its pooled "
                         f"features, and {stack.name!r}'s head gives logits of shape "
                         f"{tuple(logits.shape)} (per position); allowed: 1")
    if h.shape != out.shape:
        raise ValueError(f"groups: the embed's output {tuple(h.shape)} and the blocks' "
                         f"{tuple(out.shape)} differ; grouped heads need one shape")
    if patches > 1 and len(out.shape) != 3:
        raise ValueError(f"over: 'positions' groups the tokens of a (batch, tokens, features) "
                         f"output; {stack.name!r}'s blocks give {tuple(out.shape)}")
    if out.shape[-1] % groups:
        raise ValueError(f"groups: {groups} must divide the segments' output features "
                         f"({out.shape[-1]})")
    if patches > 1 and out.shape[1] % patches:
        raise ValueError(f"groups: {patches} must divide the segments' positions "
                         f"({out.shape[1]})")
    cells = tuple((axis, n) for axis, n in ((1, patches), (len(out.shape) - 1, groups)) if n > 1)
    count = patches * groups
    kind = (f"{patches}x{groups} cells" if patches > 1 and groups > 1 else
            f"{patches} patch groups" if patches > 1 else f"{groups} groups")
    if aggregate:
        local_head, heads = _aggregated(stack, cells, out.shape), _final_heads(stack)
        kind += ", aggregated"
    else:
        local_head, heads = _per_cell(out.shape, patches, groups, logits.shape[-1])
    return _with_local(stack, heads, local_head, kind, cells, count)


def _per_cell(shape: tuple, patches: int, groups: int, classes: int):
    """``(local_head, heads init)``: a linear head per cell, reading the cell's features (its
    group's) averaged over its positions (its patch group's; all of them without positions)."""
    fan_in = shape[-1] // groups

    def head(key: jax.Array) -> dict:
        count = patches * groups
        w = jax.random.normal(key, (count, fan_in, classes), jnp.float32)
        return {"kernel": w / jnp.sqrt(fan_in), "bias": jnp.zeros((count, classes), jnp.float32)}

    def local_head(own: dict, h: jax.Array) -> jax.Array:
        """``(P·G, B, classes)``: cell (p, g)'s logits (row p·G + g) from that cell alone."""
        b = h.shape[0]
        cells = h.reshape(b, patches, -1, groups, fan_in).mean(axis=2)  # (B, P, G, D/G)
        cells = cells.reshape(b, patches * groups, fan_in)
        w, bias = own["kernel"].astype(h.dtype), own["bias"].astype(h.dtype)
        return jnp.einsum("bcd,cdk->cbk", cells, w) + bias[:, None, :]

    return local_head, jax.jit(jax.vmap(head))


def cell_masks(shape: tuple, cells: tuple) -> jax.Array:
    """``(C, *shape[1:])`` 0/1 masks of the C cells of a segment output of ``shape``: row
    p·G + g is patch group p × feature group g (``cells``: ((axis, count), ...))."""
    masks = jnp.ones((1,) + tuple(shape[1:]), jnp.float32)
    for axis, n in cells:
        size = shape[axis]
        which = jnp.arange(size) // (size // n)  # the cell index along this axis
        one = (which[None, :] == jnp.arange(n)[:, None]).astype(jnp.float32)  # (n, size)
        one = one.reshape((n,) + (1,) * (axis - 1) + (size,) + (1,) * (len(shape) - 1 - axis))
        masks = (masks[:, None] * one[None]).reshape((-1,) + tuple(shape[1:]))
    return masks


def _aggregated(stack: Stack, cells: tuple, shape: tuple):
    """Ren et al.'s feature aggregator: cell c's logits are the local head's on the segment's
    output with every other cell held fixed and its own deviation scaled by the cell count C,
    so every cell's loss has the value ℓ and their mean has the h-gradient ∇ℓ."""
    masks = cell_masks(shape, cells)
    count = masks.shape[0]

    def local_head(own: Any, h: jax.Array) -> jax.Array:
        fixed = jax.lax.stop_gradient(h)
        own_part = (h - fixed)[None] * (count * masks[:, None]).astype(h.dtype)  # value 0
        return jax.vmap(lambda hc: stack.head(own, hc))(fixed[None] + own_part)

    return local_head
