"""A block's reverse without recomputing its forward: the vjp's residuals kept from the
forward sweep, less the two the reverse has anyway.

Why: the reverse sweep of a streamed backprop step has each block's stashed input and its
freshly read parameters; ``jax.vjp`` from those runs the block's forward again (one matmul of
three per dense layer: 4/3 of the in-memory step's FLOPs, where one forward leaves the
residuals). Here the forward sweep runs the block under ``jax.checkpoint`` with the policy
that saves matmul outputs (:data:`SAVE`), so its pullback's residuals are the parameters, the
input and those outputs; element-wise work after them is redone in the pullback (cheap). The
forward kernel returns only the matmul outputs; the reverse kernel puts the parameters it was
given and the stashed input back in their places and runs the pullback: no matmul of the
forward again.

A block whose saved outputs are not per example (a product of two parameters, which would
keep a parameter-sized copy for the whole step) or exceed :data:`MAX_RATIO` times its input
is run as before (:func:`layout` returns None): recomputed, never approximated.

Example::

    lay = layout(stack, p, h)                      # None: recompute this block
    out, res = apply_keep(stack, lay, p, h)
    gp, gh = vjp_kept(stack, lay, p, h, res, ct)   # == jax.vjp(block, p, h)[1](ct)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxstream.models.stack import Stack

MAX_RATIO = 4  # kept residual bytes per block, at most this many times its input's
SAVE = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


class Layout(NamedTuple):
    """Where each residual of a block's pullback comes from: ``("p", i)`` the i-th parameter
    leaf, ``("h", 0)`` the block's input, ``("r", j)`` the j-th kept residual."""

    treedef: Any
    sources: tuple


@functools.partial(jax.tree_util.register_dataclass, data_fields=["h", "res"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class Kept:
    """A stashed block input with its kept residuals (what the reverse sweep reads); a pytree
    of the arrays, the layout its static part (so a stash spills and returns whole)."""

    h: Any
    res: tuple
    layout: Layout


def _pullback(stack: Stack, p: Any, h: jax.Array):
    # the residuals a remat policy saves: matmul outputs (what costs FLOPs to redo); the
    # element-wise work after them is recomputed in the pullback
    block = jax.checkpoint(lambda pp, hn: stack.block(pp, hn), policy=SAVE)
    return jax.vjp(lambda pp, hh: jax.vmap(lambda hn: block(pp, hn))(hh), p, h)


def _sources(p: Any, h: Any, leaves: list) -> tuple:
    params, out, j = jax.tree.leaves(p), [], 0
    for r in leaves:
        i = next((i for i, q in enumerate(params) if r is q), None)
        if i is not None:
            out.append(("p", i))
        elif r is h:
            out.append(("h", 0))
        else:
            out.append(("r", j))
            j += 1
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _layout(stack: Stack, p_def: Any, p_avals: tuple, h_aval: Any) -> Layout | None:
    found: list = []

    def trace(p_leaves, h):
        p = jax.tree.unflatten(p_def, p_leaves)
        _, pull = _pullback(stack, p, h)
        leaves, treedef = jax.tree.flatten(pull)
        found.append((treedef, _sources(p, h, leaves), leaves))
        return 0

    jax.eval_shape(trace, list(p_avals), h_aval)
    treedef, sources, leaves = found[0]
    kept = [r for r, s in zip(leaves, sources) if s[0] == "r"]
    lead = tuple(h_aval.shape[:2])
    size = lambda a: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
    if any(tuple(r.shape[:2]) != lead for r in kept):
        return None  # a residual that is not per example: computed from the parameters
    if sum(map(size, kept)) > MAX_RATIO * size(h_aval):
        return None
    return Layout(treedef, sources)


def layout(stack: Stack, p: Any, h: jax.Array) -> Layout | None:
    """The block's residual layout for parameters ``p`` and input ``h`` (N, B, ...), or None
    where the residuals cannot be kept (see the module's docstring); cached per shape."""
    leaves, p_def = jax.tree.flatten(p)
    aval = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    return _layout(stack, p_def, tuple(map(aval, leaves)), aval(h))


@functools.partial(jax.jit, static_argnums=(0, 1))
def apply_keep(stack: Stack, lay: Layout, p: Any, h: jax.Array) -> tuple[jax.Array, tuple]:
    """The block's output and its kept residuals (those ``lay`` marks ``"r"``)."""
    out, pull = _pullback(stack, p, h)
    leaves = jax.tree.leaves(pull)
    return out, tuple(r for r, s in zip(leaves, lay.sources) if s[0] == "r")


@functools.partial(jax.jit, static_argnums=(0, 1))
def vjp_kept(stack: Stack, lay: Layout, p: Any, h: jax.Array, res: tuple, ct: jax.Array):
    """Parameter gradient (summed over micro-batches) and input cotangent of one block, from
    its kept residuals: no forward recomputation."""
    params = jax.tree.leaves(p)
    pick = {"p": params, "h": [h], "r": list(res)}
    pull = jax.tree.unflatten(lay.treedef, [pick[k][i] for k, i in lay.sources])
    return pull(ct.astype(h.dtype))
