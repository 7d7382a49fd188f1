"""Wrap flax nnx modules as a :class:`Stack`: ``nnx.split`` gives the params, ``nnx.merge``
rebuilds a module inside each pure function. This is the seam between a user's model and the
engines of jaxstream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstream.models.stack import Batch, Stack, cross_entropy


def _split_params(module: nnx.Module, what: str) -> tuple[Any, dict]:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            f"{what}: only nnx.Param state is supported in a stack (found other variables, e.g. "
            "batch statistics or RNG state); use modules without them."
        )
    return graphdef, nnx.to_pure_dict(params)


def from_nnx(
    embed: nnx.Module,
    make_block: Callable[[int], nnx.Module],
    head: nnx.Module,
    num_layers: int,
    example_loss: Callable[[jax.Array, Batch], jax.Array] = cross_entropy,
    name: str = "nnx_stack",
    num_classes: int | None = None,
) -> tuple[Stack, dict]:
    """Build a :class:`Stack` and its params from nnx modules.

    Args:
      embed: module mapping inputs ``x`` to the hidden state.
      make_block: ``l -> module``; called ``num_layers`` times; all blocks must share one
        structure (their params are stacked on a leading layer axis).
      head: module mapping the hidden state to logits.
      num_layers: number of blocks L (>= 1).
      example_loss: ``(logits, batch) -> (B,)`` per-example losses.
      name: a label.
      num_classes: the size of the logits' last axis (default: the ``out_features`` of an
        ``nnx.Linear`` head, else unknown); labels are checked against it.

    Returns:
      ``(stack, params)``; ``stack.init(key)`` returns the same initial params for any key
      (nnx modules are initialised when built; build them with ``nnx.Rngs(seed)``).

    Example:
      >>> rngs = nnx.Rngs(0)
      >>> stack, params = from_nnx(nnx.Linear(64, 32, rngs=rngs),
      ...                          lambda l: nnx.Linear(32, 32, rngs=rngs),
      ...                          nnx.Linear(32, 10, rngs=rngs), num_layers=3)
    """
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    embed_def, embed_params = _split_params(embed, "embed")
    head_def, head_params = _split_params(head, "head")
    block_defs, block_params = zip(*[_split_params(make_block(l), f"block {l}") for l in range(num_layers)])
    structure = jax.tree.structure(block_params[0])
    for l, p in enumerate(block_params):
        if jax.tree.structure(p) != structure or jax.tree.map(jnp.shape, p) != jax.tree.map(
            jnp.shape, block_params[0]
        ):
            raise ValueError(f"make_block({l}) differs in structure or shapes from make_block(0)")
    blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *block_params)
    block_def = block_defs[0]
    params = {"embed": embed_params, "blocks": blocks, "head": head_params}

    stack = Stack(
        embed=lambda p, x: nnx.merge(embed_def, p)(x),
        block=lambda p, h: nnx.merge(block_def, p)(h),
        head=lambda p, h: nnx.merge(head_def, p)(h),
        example_loss=example_loss,
        init=lambda key: params,
        num_layers=num_layers,
        name=name,
        num_classes=num_classes if num_classes is not None else _out_features(head),
    )
    return stack, params


def _out_features(head: nnx.Module) -> int | None:
    """The logits' size of an ``nnx.Linear`` head (flax states it); None for another head."""
    size = getattr(head, "out_features", None)
    return size if isinstance(head, nnx.Linear) and isinstance(size, int) else None


def nnx_stack_factory(
    build: Callable[[nnx.Rngs], tuple[nnx.Module, Callable[[int], nnx.Module], nnx.Module]],
    num_layers: int,
    example_loss: Callable[[jax.Array, Batch], jax.Array] = cross_entropy,
    name: str = "nnx_stack",
    num_classes: int | None = None,
) -> Stack:
    """A :class:`Stack` whose ``init(key)`` builds fresh nnx modules from ``key``.

    ``build(rngs) -> (embed, make_block, head)``. Module structure is taken once from seed 0;
    ``init`` re-runs ``build`` under ``nnx.Rngs(key)`` for new values. ``num_classes``: as
    :func:`from_nnx`.
    """
    template, _ = from_nnx(*build(nnx.Rngs(0)), num_layers, example_loss, name, num_classes)

    def init(key: jax.Array) -> dict:
        return from_nnx(*build(nnx.Rngs(params=key)), num_layers, example_loss, name)[1]

    return Stack(
        embed=template.embed,
        block=template.block,
        head=template.head,
        example_loss=example_loss,
        init=init,
        num_layers=num_layers,
        name=name,
        num_classes=template.num_classes,
    )
