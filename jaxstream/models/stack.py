"""A model as a *stack*: embed -> L identical blocks -> head -> per-example loss.

The parameters are a dict ``{"embed": ..., "blocks": ..., "head": ...}`` whose ``"blocks"``
leaves carry a leading layer axis of size L. A pipeline stage or a streamed layer is then just
a slice of ``"blocks"``, and every engine in jaxstream (in-memory, pipelined, streamed) runs the
same three functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]
Batch = dict[str, jax.Array]


#: The fix an error gives when an estimator that works on blocks gets another model.
AS_STACK = ("; a sequential model becomes one with jaxstream.models.as_stack(model) (or "
            "as_padded_stack(model, x))")


@dataclasses.dataclass(frozen=True, eq=False)
class Stack:
    """embed -> ``num_layers`` blocks -> head -> per-example loss, as pure functions.

    A ``Stack`` is itself a ``loss_fn(params, batch) -> scalar`` (the mean per-example loss), so it
    can be handed to any estimator; estimators that know about stacks use the layer structure
    (scan over blocks, tangents regenerated per layer).

    Attributes:
      embed: ``(embed_params, x) -> h``.
      block: ``(one_block_params, h) -> h``; one slice of ``params["blocks"]``.
      head: ``(head_params, h) -> logits``.
      example_loss: ``(logits, batch) -> (B,)`` per-example losses.
      init: ``key -> params``.
      num_layers: L, the size of the leading axis of every ``params["blocks"]`` leaf.
      name: a label for tables and plots.
      shared_head: False where the head reads only the last block's output (a padded stack,
        whose blocks' outputs differ): local losses, which apply the head to every block's
        output, are then refused.
      local_head: ``(local_head_params, h) -> logits`` where the embed and every block carry
        their own local head (``params["embed"|"blocks"] = {"module", "local_head"}``, built by
        :func:`jaxstream.models.with_local_heads`); None: local losses use the shared head.
      local_groups: C, the cells of a segment's output that each have a local loss of their
        own (``local_head`` then returns ``(C, B, classes)``: cell ``c``'s logits, whose
        dependence on the output runs through cell ``c`` alone, so its tangent reaches only its
        own loss); 1: one loss.
      local_cells: ((axis, count), ...): the axes of a segment's output that its local-loss
        cells split, in ascending order (``(1, P)``: P groups of a (B, T, D) output's tokens;
        ``(ndim - 1, G)``: G groups of its features); the cells are row-major, ``local_groups``
        of them. Empty: one loss.
      num_classes: the size of the logits' last axis where the builder knows it (the zoo
        models, a stack from an nnx ``Linear`` head, a view of a sequential model ending in
        one); None: unknown. Concrete cross-entropy labels are checked against it.

    Example:
      >>> stack = mlp(in_dim=64, width=32, depth=2, num_classes=10)
      >>> params = stack.init(jax.random.key(0))
      >>> loss = stack(params, {"x": jnp.zeros((4, 64)), "y": jnp.zeros((4,), jnp.int32)})
    """

    embed: Callable[[Any, jax.Array], jax.Array]
    block: Callable[[Any, jax.Array], jax.Array]
    head: Callable[[Any, jax.Array], jax.Array]
    example_loss: Callable[[jax.Array, Batch], jax.Array]
    init: Callable[[jax.Array], Params]
    num_layers: int
    name: str = "stack"
    shared_head: bool = True
    local_head: Callable[[Any, jax.Array], jax.Array] | None = None
    local_groups: int = 1
    local_cells: tuple = ()
    num_classes: int | None = None

    def __call__(self, params: Params, batch: Batch) -> jax.Array:
        """Mean loss of ``batch``."""
        return jnp.mean(self.example_losses(params, batch))

    def example_losses(self, params: Params, batch: Batch) -> jax.Array:
        """Per-example losses, shape (B,)."""
        return self.example_loss(self.apply(params, batch["x"]), batch)

    def run_blocks(self, blocks: Any, h: jax.Array) -> jax.Array:
        """Apply a (slice of) stacked blocks in order with ``lax.scan``."""

        def body(h, p):
            return self.block(p, h), None

        h, _ = jax.lax.scan(body, h, blocks)
        return h

    def apply(self, params: Params, x: jax.Array) -> jax.Array:
        """Logits of inputs ``x``."""
        h = self.embed(params["embed"], x)
        h = self.run_blocks(params["blocks"], h)
        return self.head(params["head"], h)

    def accuracy(self, params: Params, batch: Batch) -> jax.Array:
        """Share of correct argmax predictions (over all positions for sequence models)."""
        logits = self.apply(params, batch["x"])
        return jnp.mean(jnp.argmax(logits, axis=-1) == batch["y"])


def is_stack_params(params: Any) -> bool:
    """True if ``params`` has the ``{"embed", "blocks", "head"}`` layout of a stack."""
    return isinstance(params, dict) and set(params) == {"embed", "blocks", "head"}


def layer_slice(params: Params, l: int | jax.Array) -> Any:
    """Parameters of block ``l`` (one slice of the stacked blocks)."""
    return jax.tree.map(lambda a: a[l], params["blocks"])


def slice_blocks(params: Params, start: int, stop: int) -> Params:
    """A stack's params restricted to blocks ``start:stop`` (embed and head kept)."""
    return {
        "embed": params["embed"],
        "blocks": jax.tree.map(lambda a: a[start:stop], params["blocks"]),
        "head": params["head"],
    }


def loss_dtype(*dtypes: Any) -> Any:
    """The dtype a loss (or a sum of scalars) is computed in: the widest floating dtype of
    ``dtypes`` and float32 (bf16 / fp16 -> float32, float64 stays), chosen by width so that it
    holds under strict dtype promotion too."""
    floats = [jnp.dtype(d) for d in dtypes if jnp.issubdtype(d, jnp.floating)]
    return max([jnp.dtype(jnp.float32), *floats], key=lambda d: d.itemsize)


def cross_entropy(logits: jax.Array, batch: Batch) -> jax.Array:
    """Per-example softmax cross-entropy with integer labels ``batch["y"]``.

    For sequence logits (B, T, V) the loss is averaged over T, giving (B,). Computed in at least
    float32 (bf16 / fp16 logits are upcast; float64 logits stay float64, so float64 references
    check every engine at float64 precision).
    """
    y = batch["y"]
    if jnp.shape(y) != logits.shape[:-1]:  # a shape is static: no cost in a jitted step
        hint = " (one-hot labels? give y.argmax(-1))" if jnp.shape(y) == logits.shape else ""
        raise ValueError(f"batch['y'] has shape {jnp.shape(y)}; cross-entropy takes integer "
                         f"class labels shaped as the logits {logits.shape} without their "
                         f"last axis, {logits.shape[:-1]}{hint}")
    logp = jax.nn.log_softmax(logits.astype(loss_dtype(logits.dtype)), axis=-1)
    nll = -jnp.take_along_axis(logp, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return nll.reshape(nll.shape[0], -1).mean(axis=1)
