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

Example:
  >>> stack = with_local_heads(mlp(in_dim=40, width=100, depth=1, num_classes=10))
  >>> params = stack.init(jax.random.key(0))
  >>> loss, grads = forward(perturb="activations", local_losses=True)(stack, params, batch, key)
  >>> grouped = with_local_heads(mlp(40, 128, 1, 10), groups=16, x=batch["x"])   # M/1/16
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.models.stack import Stack

LOCAL = 0x10CA1  # key segment of the local heads' initialisation


def with_local_heads(stack: Stack, groups: int = 1, x: Any = None,
                     over: str = "features") -> Stack:
    """``stack`` with a local head of the final head's shape on the embed and on every block;
    ``groups`` > 1: G linear heads per segment, one per group of its output features (``x``,
    a few inputs, gives the features' and the classes' sizes), or with ``over="positions"``
    one per group of its positions (tokens, patches: an output (B, T, D), T split into G
    contiguous groups, each head reading its group's mean features; Ren et al.'s patch-wise
    losses).

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
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups: must be an integer >= 1, got {groups!r}")
    if over not in ("features", "positions"):
        raise ValueError(f"over: must be 'features' or 'positions', got {over!r}")
    if groups > 1:
        return _grouped(stack, groups, x, over)
    heads = jax.jit(jax.vmap(lambda k: stack.init(k)["head"]))

    def init(key: jax.Array) -> dict:
        params = stack.init(key)
        own = heads(jax.random.split(jax.random.fold_in(key, LOCAL), stack.num_layers + 1))
        return _with_heads(params, own)

    return dataclasses.replace(
        stack, embed=lambda p, x: stack.embed(p["module"], x),
        block=lambda p, h: stack.block(p["module"], h), init=init, local_head=stack.head,
        name=f"{stack.name}+local heads")


def _with_heads(params: dict, own: Any) -> dict:
    """``params`` with local heads ``own`` (a leading axis: the embed's, then each block's)."""
    first = jax.tree.map(lambda a: a[0], own)
    rest = jax.tree.map(lambda a: a[1:], own)
    return {"embed": {"module": params["embed"], "local_head": first},
            "blocks": {"module": params["blocks"], "local_head": rest},
            "head": params["head"]}


def _grouped(stack: Stack, groups: int, x: Any, over: str = "features") -> Stack:
    """The ``groups`` > 1 case of :func:`with_local_heads`."""
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
    axis = len(out.shape) - 1 if over == "features" else 1
    if over == "positions" and len(out.shape) != 3:
        raise ValueError(f"over: 'positions' groups the tokens of a (batch, tokens, features) "
                         f"output; {stack.name!r}'s blocks give {tuple(out.shape)}")
    size, classes = out.shape[axis], logits.shape[-1]
    if size % groups:
        what = "output features" if over == "features" else "positions"
        raise ValueError(f"groups: {groups} must divide the segments' {what} ({size})")
    fan_in = size // groups if over == "features" else out.shape[-1]

    def head(key: jax.Array) -> dict:
        w = jax.random.normal(key, (groups, fan_in, classes), jnp.float32)
        return {"kernel": w / jnp.sqrt(fan_in), "bias": jnp.zeros((groups, classes), jnp.float32)}

    heads = jax.jit(jax.vmap(head))

    def init(key: jax.Array) -> dict:
        own = heads(jax.random.split(jax.random.fold_in(key, LOCAL), stack.num_layers + 1))
        return _with_heads(stack.init(key), own)

    def local_head(own: dict, h: jax.Array) -> jax.Array:
        """``(G, B, classes)``: group g's logits from group g alone (its features pooled over
        the positions, or its positions' mean features)."""
        if over == "features":
            pooled = h.reshape(h.shape[0], -1, h.shape[-1]).mean(axis=1)
            grouped = pooled.reshape(h.shape[0], groups, -1)
        else:
            grouped = h.reshape(h.shape[0], groups, -1, h.shape[-1]).mean(axis=2)
        w, b = own["kernel"].astype(h.dtype), own["bias"].astype(h.dtype)
        return jnp.einsum("bgd,gdc->gbc", grouped, w) + b[:, None, :]

    return dataclasses.replace(
        stack, embed=lambda p, x: stack.embed(p["module"], x),
        block=lambda p, h: stack.block(p["module"], h), init=init, local_head=local_head,
        local_groups=groups, local_group_axis=axis,
        name=f"{stack.name}+local heads/{groups} {'groups' if over == 'features' else 'patch groups'}")
