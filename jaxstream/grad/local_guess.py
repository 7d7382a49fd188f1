"""Local-guess forward gradients (Fournier, Rivaud, Belilovsky, Eickenberg, Oyallon: "Can
forward gradient match backpropagation?", ICML 2023).

A random tangent is almost orthogonal to the gradient in high dimension. A *guess* direction
U that already correlates with it does better: here U is, segment by segment, the exact
gradient of that segment's local loss (its output fed to a head, as the local-loss estimators
define it: the shared final head held fixed, or the segment's own local head on a
:func:`~jaxstream.models.with_local_heads` stack), and the head's U is its exact gradient of
the global loss. One jvp of the global loss along U gives d = ∇L·U, and the estimate is the
projection of the gradient on the guess,

    ĝ = (∇L·U) U / ‖U‖²,

deterministic given the batch, biased (it keeps only the part of ∇L along U) but never
pointing away from it: ĝ·∇L = (∇L·U)² / ‖U‖² ≥ 0. Its cosine to ∇L is the guess's. Own local
heads follow the exact gradient of their loss and are left out of U and ‖U‖² (the global loss
does not read them).

Cost: one forward pass with each segment's local backward (U), and one jvp of the global loss.

Example:
  >>> loss, grads = local_guess()(stack, params, batch, key)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad import segments as sg
from jaxstream.grad.checks import check_examples, check_inputs, check_labels, check_local_losses
from jaxstream.grad.plan import Plan
from jaxstream.models.stack import AS_STACK, Stack, loss_dtype


def _guess_kernel(stack: Stack, head: Any, example: Callable) -> Callable:
    """Segment kernel: ``(out, exact gradient of the segment's local loss)`` (the head's: of the
    global loss). On own local heads: ``{"module": guess, "local_head": its exact gradient}``."""

    def exact(fn, p, loss):
        out, pull = jax.vjp(fn, p)
        ct = jax.grad(lambda o: jnp.mean(loss(o)))(out)
        return out, pull(ct)[0]

    def kernel(fn, p, seg):
        if isinstance(seg, str) and seg == "head":
            return exact(fn, p, example)
        if stack.local_head is None:
            return exact(fn, p, lambda h: example(stack.head(head, h)))
        own = p["local_head"]
        out, g = exact(lambda m: fn({"module": m, "local_head": own}), p["module"],
                       lambda h: jnp.mean(sg.own_losses(stack, own, h, example), axis=0))
        return out, {"module": g, "local_head": sg.own_head_grad(stack, own, out, example)}

    return kernel


def _split(stack: Stack, tree: dict) -> tuple[dict, dict | None]:
    """(the part of a params-like tree the global loss reads, the own local heads or None)."""
    if stack.local_head is None:
        return tree, None
    heads = {k: tree[k]["local_head"] for k in ("embed", "blocks")}
    return {"embed": tree["embed"]["module"], "blocks": tree["blocks"]["module"],
            "head": tree["head"]}, heads


def _join(stack: Stack, core: dict, heads: dict | None) -> dict:
    if heads is None:
        return core
    return {"embed": {"module": core["embed"], "local_head": heads["embed"]},
            "blocks": {"module": core["blocks"], "local_head": heads["blocks"]},
            "head": core["head"]}


@dataclasses.dataclass(frozen=True)
class LocalGuess:
    """Local-guess forward gradient (see :func:`local_guess`)."""

    @property
    def plan(self) -> Plan:
        """A guess pass of its own: engines that do not run it refuse it by name."""
        return Plan("local_guess", "none")

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array | None = None,
                 *, diagnostics: bool = False):
        if not isinstance(loss_fn, Stack):
            raise TypeError("local_guess needs a model Stack as loss_fn (a local loss per "
                            f"block); got {type(loss_fn).__name__}" + AS_STACK)
        check_labels(loss_fn, batch, "local_guess")
        check_examples(batch, "local_guess")
        check_local_losses(loss_fn, True, "local_guess")
        check_inputs(loss_fn, params, batch, "local_guess")
        stack = loss_fn
        example = lambda lg: stack.example_loss(lg.astype(loss_dtype(lg.dtype)), batch)
        _, guess = sg.segment_sweep(stack, params, batch["x"],
                                    _guess_kernel(stack, params["head"], example))
        u, heads = _split(stack, guess)
        core, own = _split(stack, params)
        loss, d = jax.jvp(lambda c: stack(_join(stack, c, own), batch), (core,), (u,))
        norm2 = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(u))
        scale = d / jnp.maximum(norm2, jnp.finfo(jnp.float32).tiny)
        est = jax.tree.map(lambda x: (scale * x).astype(x.dtype), u)
        grads = _join(stack, est, heads)
        if diagnostics:
            return loss, grads, {"directional": d, "guess_norm2": norm2}
        return loss, grads


def local_targets(stack: Stack, params: Any, batch: dict) -> Any:
    """The exact gradient of every segment's local loss, shaped like ``params`` (the head's:
    of the global loss; own local heads: their exact gradients): what the local-loss
    estimators (LG-FG-A, LG-FG-W, with groups too) estimate without bias, and the local
    guess's direction. For a diagnostic: the cosine of an estimate to it, beside the cosine to
    the global gradient, tells the estimator's noise apart from the local losses' bias.

    Example:
      >>> target = local_targets(stack, params, batch)   # what LG-FG-A is unbiased for
    """
    check_local_losses(stack, True, "local_targets")
    example = lambda lg: stack.example_loss(lg.astype(loss_dtype(lg.dtype)), batch)
    return sg.segment_sweep(stack, params, batch["x"],
                            _guess_kernel(stack, params["head"], example))[1]


def local_guess() -> LocalGuess:
    """Local-guess forward gradient (Fournier et al., ICML 2023): the gradient projected on the
    direction of the segments' local-loss gradients, ĝ = (∇L·U) U / ‖U‖², with one jvp.

    Biased (only the part of the gradient along the guess), deterministic for a batch, and
    never pointing away from the gradient. Needs a model :class:`~jaxstream.models.Stack`; on a
    :func:`~jaxstream.models.with_local_heads` stack the guesses come from the blocks' own
    heads, which follow their exact local gradients. Runs in memory, data parallel (independent
    shards), on the pipeline (two passes of a forward-only table), the stream engine and the
    composed engine (three sweeps: the exact local gradients, along them, the update).

    Example:
      >>> loss, grads = local_guess()(stack, params, batch, key)
    """
    return LocalGuess()
