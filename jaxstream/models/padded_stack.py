"""A sequential model *without* repeated layers (the tutorial CNN) as a
:class:`~jaxstream.models.Stack`, so that pipeline stages, the layer store and the composed
engine can place and stream it layer by layer.

Those engines move identical blocks: every layer's parameters one slice of a stacked array,
every stage's activations one shape. :func:`as_padded_stack` gives a model whose layers differ
that form by padding:

* the layers are cut into *groups*: each layer with parameters together with the parameter-free
  layers after it (``Conv, relu, avg_pool`` is one group). The first group (with any
  parameter-free layers before it) is the stack's embed, the last group the head, every group
  between them one block — so a model needs at least three layers with parameters;
* a block's parameters are one flat vector ``{"w": (P,)}``, zero-padded to the largest block
  (P), so the blocks stack into ``(L, P)``;
* activations between blocks are flat per example, zero-padded to the largest (H), plus one
  column that carries the index of the next block: a block reads it and runs its own layers with
  ``lax.switch``. That column and the padding never reach the loss.

The gradients of the real parameters are the model's (tested against ``jax.grad``), and a
directional derivative along a padded tangent equals the model's along the unpadded one. The
engines' estimators therefore estimate the same gradient with the same distribution as on the
model itself, but their tangents are drawn in the padded layout (one vector per block), so they
are not the same draws as the model's in-memory estimator for the same key: compare an engine
with the in-memory estimator on ``view.stack``. The padding coordinates receive pure estimator
noise (v·d) that touches nothing: :meth:`PaddedView.unstack` drops it, and the optimizer's updates
of those coordinates are never read. Costs: every block holds P parameters and H activations
(the largest layer's), and under ``vmap`` over micro-batches the switch runs every branch.

Example:
    >>> rngs = nnx.Rngs(0)
    >>> cnn = from_sequential(nnx.Sequential(
    ...     nnx.Conv(1, 8, (3, 3), rngs=rngs), nnx.relu, pool,
    ...     nnx.Conv(8, 8, (3, 3), rngs=rngs), nnx.relu, pool, flatten,
    ...     nnx.Linear(32, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 10, rngs=rngs)))
    >>> view = as_padded_stack(cnn, batch["x"])   # embed: conv 1; blocks: conv 2, dense 1; head
    >>> params = view.params(cnn.init(None))
    >>> loss, grads = jaxstream.grad.backprop()(view.stack, params, batch, key)
    >>> cnn_grads = view.unstack(grads)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.models.seq_stack import (
    as_stack,
    check_pure,
    check_shared_buffers,
    find_blocks,
    run_layers,
)
from jaxstream.models.sequential import Sequential
from jaxstream.models.stack import Stack

MAX_BLOCKS = 256  # the block index is carried exactly in bf16 activations up to 256


@dataclasses.dataclass(frozen=True)
class _Block:
    """One block: its layers, their parameter leaves (layer position, tree, shapes, dtypes),
    its input and output shapes per example."""

    layers: tuple[int, ...]
    treedefs: tuple  # per layer of the group: the params' treedef
    shapes: tuple  # per layer: tuple of leaf shapes
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return sum(math.prod(s) for ls in self.shapes for s in ls)


@dataclasses.dataclass(frozen=True, eq=False)
class PaddedView:
    """A sequential model seen as embed → padded blocks → head (see the module docstring).

    Attributes:
      stack: the :class:`Stack` (one object per model: jitted engines cache on it).
      model: the sequential model.
      embed_layers, head_layers: the layers of the embed and of the head.
      blocks: one entry per block (its layers, parameter shapes, activation shapes).
      param_width: P, the padded parameter count of a block.
      act_width: H, the padded activation width per example (one more column carries the
        block index).
      dtype: the parameters' dtype.
    """

    stack: Stack
    model: Sequential
    embed_layers: tuple[int, ...]
    head_layers: tuple[int, ...]
    blocks: tuple[_Block, ...]
    param_width: int
    act_width: int
    dtype: Any

    def params(self, seq_params: tuple) -> dict:
        """The model's parameters (one dict per layer) in the stack's layout."""
        flat = []
        for blk in self.blocks:
            leaves = [a for l in blk.layers for a in jax.tree.leaves(seq_params[l])]
            v = (jnp.concatenate([jnp.ravel(a).astype(self.dtype) for a in leaves])
                 if leaves else jnp.zeros((0,), self.dtype))
            flat.append(jnp.pad(v, (0, self.param_width - v.shape[0])))
        return {"embed": _segment(seq_params, self.embed_layers),
                "blocks": {"w": jnp.stack(flat)},
                "head": _segment(seq_params, self.head_layers)}

    def unstack(self, params: dict) -> tuple:
        """Stack-layout parameters (or gradients) back in the model's layout (padding dropped)."""
        out = [{} for _ in range(self.model.num_layers)]
        for seg, layers in (("embed", self.embed_layers), ("head", self.head_layers)):
            for j, l in enumerate(layers):
                out[l] = params[seg].get(str(j), {})
        for k, blk in enumerate(self.blocks):
            for l, p in zip(blk.layers, _unflatten(blk, params["blocks"]["w"][k])):
                out[l] = p
        return tuple(out)


def _segment(seq_params: tuple, layers: tuple[int, ...]) -> dict:
    return {str(j): seq_params[l] for j, l in enumerate(layers) if jax.tree.leaves(seq_params[l])}


def _unflatten(blk: _Block, w: jax.Array) -> list:
    """The block's per-layer parameter trees from its padded flat vector (static slices)."""
    out, off = [], 0
    for treedef, shapes in zip(blk.treedefs, blk.shapes):
        leaves = []
        for s in shapes:
            n = math.prod(s)
            leaves.append(w[off:off + n].reshape(s))
            off += n
        out.append(jax.tree.unflatten(treedef, leaves))
    return out


def _groups(model: Sequential) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """(parameter-free layers before the first layer with parameters, groups)."""
    with_params = [l for l in range(model.num_layers) if model.layers[l].has_params]
    lead = tuple(range(with_params[0])) if with_params else ()
    bounds = with_params + [model.num_layers]
    return lead, [tuple(range(a, b)) for a, b in itertools.pairwise(bounds)]


def as_padded_stack(model: Sequential, x: Any) -> PaddedView:
    """The model as a padded :class:`Stack` (see the module docstring).

    Args:
      model: a :func:`~jaxstream.models.from_sequential` model.
      x: an input batch (or a ``jax.ShapeDtypeStruct``) with the batch axis first: it fixes the
        shape of every layer's output.

    Raises:
      ValueError: fewer than three layers with parameters; BatchNorm statistics or dropout (a
        stack's blocks are pure functions of parameters and inputs); a layer that changes the
        batch axis; mixed parameter dtypes; more than 256 blocks.
    """
    check_pure(model)
    lead, groups = _groups(model)
    if len(groups) < 3:
        raise ValueError(f"model: {model.name!r} has {len(groups)} layers with parameters; a "
                         "padded stack needs at least 3 (embed, one block or more, head)")
    if len(groups) - 2 > MAX_BLOCKS:
        raise ValueError(f"model: {len(groups) - 2} blocks; a padded stack holds at most "
                         f"{MAX_BLOCKS}")
    dtypes = {jnp.result_type(a) for p in model.params for a in jax.tree.leaves(p)}
    if len(dtypes) > 1:
        raise ValueError(f"model: parameters of several dtypes {sorted(map(str, dtypes))}; a "
                         "padded stack keeps one flat vector per block: use one dtype")
    shapes = _layer_shapes(model, x)
    embed_l, head_l = lead + groups[0], groups[-1]
    blocks = tuple(_Block(
        layers=g,
        treedefs=tuple(jax.tree.structure(model.params[l]) for l in g),
        shapes=tuple(tuple(tuple(np.shape(a)) for a in jax.tree.leaves(model.params[l]))
                     for l in g),
        in_shape=shapes[g[0]], out_shape=shapes[g[-1] + 1]) for g in groups[1:-1])
    pw = max(b.size for b in blocks)
    hw = max(math.prod(s) for b in blocks for s in (b.in_shape, b.out_shape))
    run = functools.partial(run_layers, model)

    def embed(p, x):
        return _pad(run(embed_l, p, x), hw, 0)

    def head(p, h):
        return run(head_l, p, _read(h, blocks[-1].out_shape))

    def block(p, h):
        idx = jnp.round(jax.lax.stop_gradient(h[..., 0, -1])).astype(jnp.int32)

        def branch(k):
            blk = blocks[k]

            def f(w, hh):
                y = _read(hh, blk.in_shape)
                for l, lp in zip(blk.layers, _unflatten(blk, w)):
                    y = model.layer_fn(l)(lp, y)
                return _pad(y.astype(hh.dtype), hw, k + 1)
            return f

        return jax.lax.switch(idx, [branch(k) for k in range(len(blocks))], p["w"], h)

    stack = Stack(embed=embed, block=block, head=head, example_loss=model.example_loss,
                  init=lambda key: None, num_layers=len(blocks), name=model.name,
                  shared_head=False, num_classes=model.num_classes)
    view = PaddedView(stack, model, embed_l, head_l, blocks, pw, hw, dtypes.pop())
    return dataclasses.replace(view, stack=dataclasses.replace(
        stack, init=lambda key: view.params(model.init(key))))


def _pad(y: jax.Array, width: int, index: int) -> jax.Array:
    """``(B, ...)`` → ``(B, width + 1)``: flat, zero-padded, the last column ``index``."""
    flat = y.reshape(y.shape[0], -1)
    col = jnp.full((y.shape[0], 1), index, y.dtype)
    return jnp.concatenate(
        [flat, jnp.zeros((y.shape[0], width - flat.shape[1]), y.dtype), col], axis=1)


def _read(h: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The real activations ``(B, *shape)`` of a padded ``(B, width + 1)``."""
    return h[:, :math.prod(shape)].reshape((h.shape[0],) + tuple(shape))


def _layer_shapes(model: Sequential, x: Any) -> list[tuple[int, ...]]:
    """Per-example shape of the input of every layer, and of the output (index num_layers)."""
    h = jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", jnp.float32))
    if len(h.shape) < 1:
        raise ValueError("x: expected an input batch with the batch axis first")
    b, out = h.shape[0], [tuple(h.shape[1:])]
    for l in range(model.num_layers):
        h = jax.eval_shape(model.layer_fn(l), model.params[l], h)
        if not h.shape or h.shape[0] != b:
            raise ValueError(f"model: layer {l} turns a batch of {b} into shape {h.shape}; a "
                             "padded stack needs every layer to keep the batch axis first")
        out.append(tuple(h.shape[1:]))
    return out


def to_stack(model: Any, x: Any = None) -> Any:
    """The stack an engine that places or streams blocks runs: a :class:`Stack` as it is; a
    sequential model through :func:`~jaxstream.models.seq_stack.as_stack` when it has a
    repeated group of layers (whose blocks hold the same non-trainable variables), else through
    :func:`as_padded_stack` (``x``: an input batch).

    Raises:
      ValueError: as those two (``x`` is needed for a model without a repeated group).
    """
    if not isinstance(model, Sequential):
        return model
    try:  # a repeated group whose blocks share their non-trainable variables
        check_shared_buffers(model, *find_blocks(model))
    except ValueError:
        if x is None:
            raise ValueError(f"model: {model.name!r} has no repeated group of layers (of "
                             "blocks with the same non-trainable variables); padding it into a "
                             "stack needs an input batch x") from None
        return as_padded_stack(model, x).stack
    return as_stack(model).stack
