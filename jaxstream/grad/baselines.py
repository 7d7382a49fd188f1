"""Baselines a forward-gradient result has to beat, with the estimator signature.

* :func:`backprop_remat` — backprop that rematerialises each block of a stack
  (``jax.checkpoint``): only block inputs are kept for the backward pass, the block's inside
  is recomputed. Same gradient as :func:`~jaxstream.grad.backprop`, less temporary memory,
  about one extra forward pass of compute. With ``accumulate=A`` the batch runs as A equal
  chunks one after another (gradient accumulation): the activations of one chunk at a time.
* :func:`exact_subset` — the exact gradient of the ``k`` micro-batches a hybrid would select,
  and nothing else: the hybrid without its forward part. If a hybrid does not beat it, its
  forward part carried no information.
* :func:`local_forward_weights` — LG-FG-W (Ren et al., 2023): weight perturbation where each
  module follows the forward gradient of its own local loss (the shared head applied to its
  output); the head follows the global loss.

The exact subset is chosen with the hybrid's key schedule,
``jax.random.choice(fold_in(key, 0x7FFFFFFF), N, (k,), replace=False)``, so ``exact_subset``
and ``hybrid(num_exact=k)`` see the same micro-batches for the same key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad import corrections as cr
from jaxstream.grad import segments as sg
from jaxstream.grad.checks import check_local_losses
from jaxstream.grad.exact import group_exact_mean
from jaxstream.grad.hybrid import micro_batches_of
from jaxstream.grad.plan import Plan
from jaxstream.grad.tangents import Distribution, TangentSpec
from jaxstream.models.sequential import fold_rng
from jaxstream.models.stack import AS_STACK, Stack

SELECT = 0x7FFFFFFF  # the hybrid's key segment for its random choice of exact micro-batches


def _finish(loss, grads, diag, diagnostics: bool):
    return (loss, grads, diag) if diagnostics else (loss, grads)


def select_exact(key: jax.Array, n: int, k: int) -> jax.Array:
    """Indices (k,) of the micro-batches with exact gradients, as :class:`~jaxstream.grad.Hybrid`
    draws them for ``num_exact=k``."""
    if not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"num_exact must be an int in [1, N={n}], got {k!r}")
    return jax.random.choice(jax.random.fold_in(key, SELECT), n, (k,), replace=False)


def remat_loss(stack: Stack, params: dict, batch: dict) -> jax.Array:
    """Mean loss of a stack with every block wrapped in ``jax.checkpoint``."""
    block = jax.checkpoint(stack.block)
    h = stack.embed(params["embed"], batch["x"])
    h, _ = jax.lax.scan(lambda c, p: (block(p, c), None), h, params["blocks"])
    return jnp.mean(stack.example_loss(stack.head(params["head"], h), batch))


def accumulated(value_and_grad: Callable, params: Any, batch: Any, chunks: int):
    """(mean loss, mean gradient) of ``batch`` run as ``chunks`` equal chunks one after another
    (a ``lax.scan``: one chunk's activations live at a time), the gradient summed in at least
    float32 and returned in the parameters' dtypes. ``value_and_grad(params, chunk, a)`` gets
    the chunk's index ``a`` (its model's randomness: :func:`~jaxstream.models.sequential.fold_rng`)."""
    sizes = {x.shape[0] for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or next(iter(sizes)) % chunks:
        raise ValueError(f"accumulate: {chunks} chunks must divide the batch's leading size, "
                         f"got {sorted(sizes)}")
    split = jax.tree.map(lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]), batch)

    def body(acc, xs):
        loss, g = value_and_grad(params, *xs)
        return jax.tree.map(lambda a, x: a + x.astype(a.dtype), acc, g), loss

    zero = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)),
                        params)
    total, losses = jax.lax.scan(body, zero, (split, jnp.arange(chunks)))
    grads = jax.tree.map(lambda t, p: (t / chunks).astype(p.dtype), total, params)
    return jnp.mean(losses), grads


def _remat(loss_fn: Callable) -> Callable:
    """``loss_fn`` recomputed in its backward pass: per block for a stack, whole otherwise."""
    if isinstance(loss_fn, Stack):
        return lambda p, b: remat_loss(loss_fn, p, b)
    return jax.checkpoint(loss_fn)  # one segment: recompute the whole forward


@dataclasses.dataclass(frozen=True)
class BackpropRemat:
    """Exact gradient with each block rematerialised (see :func:`backprop_remat`)."""

    accumulate: int = 1  # chunks of the batch run one after another (gradient accumulation)
    plan = Plan("none", "all")  # an engine recomputes each block from its input anyway

    def __post_init__(self):
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate must be an int >= 1, got {self.accumulate!r}")

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array | None = None,
                 *, diagnostics: bool = False):
        if self.accumulate == 1:
            loss, grads = jax.value_and_grad(_remat(loss_fn))(params, batch)
        else:  # chunk a draws the model's randomness from fold_rng(loss_fn, a)
            value_and_grad = lambda p, b, a: jax.value_and_grad(_remat(fold_rng(loss_fn, a)))(p, b)
            loss, grads = accumulated(value_and_grad, params, batch, self.accumulate)
        return _finish(loss, grads, {}, diagnostics)


def backprop_remat(accumulate: int = 1) -> BackpropRemat:
    """Backprop with per-block rematerialisation (``jax.checkpoint``): exact gradients.

    ``accumulate=A`` runs the batch as A equal chunks one after another and averages their
    gradients (gradient accumulation): the same gradient at about 1/A of the activations'
    memory, for one parameter-sized accumulator (a model with a bound key draws chunk a's
    dropout masks from ``fold_in(model.rng, a)``, as a micro-batch does). The engines that run
    their own exact sweeps (pipeline, stream, composed) compute the same gradient by their own
    schedule; ``A`` is an in-memory schedule.

    Example:
      >>> loss, grads = backprop_remat(accumulate=4)(stack, params, batch, key)
    """
    return BackpropRemat(accumulate)


@dataclasses.dataclass(frozen=True)
class ExactSubset:
    """Mean exact gradient of ``num_exact`` randomly chosen micro-batches (see :func:`exact_subset`)."""

    num_exact: int = 1

    def __post_init__(self):
        if not isinstance(self.num_exact, int) or self.num_exact < 1:
            raise ValueError(f"num_exact must be an int >= 1, got {self.num_exact!r}")

    @property
    def plan(self) -> Plan:
        """Exact gradients of the selected micro-batches, nothing forward: their mean."""
        return Plan("none", "selected", None, micro_batches=True, select=self.selection,
                    num_exact=self.num_exact)

    def selection(self, n: int, key: jax.Array, num_layers: int | None = None):
        """(indices, depth) as :meth:`jaxstream.grad.Hybrid.selection` draws them."""
        return select_exact(key, n, self.num_exact), jnp.zeros((self.num_exact,), jnp.int32)

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array,
                 *, diagnostics: bool = False):
        n = micro_batches_of(batch)
        idx = select_exact(key, n, self.num_exact)
        sub = jax.tree.map(lambda x: jnp.asarray(x)[idx], batch)
        # the hybrid's exact part: one rematerialised sweep, no per-micro-batch gradient trees
        masks = cr.group_masks(params, jnp.zeros((self.num_exact,), jnp.int32))
        grads, _, losses = group_exact_mean(loss_fn, params, sub, masks, idx)
        return _finish(jnp.mean(losses), grads, {"exact_indices": idx}, diagnostics)


def exact_subset(num_exact: int = 2) -> ExactSubset:
    """Exact gradients of ``num_exact`` of the N micro-batches only (no forward part).

    ``batch`` leaves carry a leading micro-batch axis N, as for :func:`~jaxstream.grad.hybrid`;
    the selection is the hybrid's for the same key, and so are a bound model key's draws
    (micro-batch n: ``fold_in(model.rng, n)``). Unbiased for the full batch's gradient; its
    noise is that of a batch ``num_exact / N`` as large. The returned loss is the mean over the
    selected micro-batches (the others are never evaluated).

    Example:
      >>> micro = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch)
      >>> loss, grads = exact_subset(2)(stack, params, micro, key)
    """
    return ExactSubset(num_exact)


@dataclasses.dataclass(frozen=True)
class LocalForwardWeights:
    """LG-FG-W: per-module weight-perturbed forward gradients of local losses."""

    spec: TangentSpec = TangentSpec()

    @property
    def plan(self) -> Plan:
        """Weight tangents per block on the block's own local loss."""
        return Plan("local_weights", "none", None, self.spec)

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array,
                 *, diagnostics: bool = False):
        if not isinstance(loss_fn, Stack):
            raise TypeError("local_forward_weights needs a model Stack as loss_fn (local losses "
                            f"per block); got {type(loss_fn).__name__}" + AS_STACK)
        check_local_losses(loss_fn, True, "local_forward_weights")
        loss, grads = _local_weights(loss_fn, self.spec, params, batch, key)
        return _finish(loss, grads, {}, diagnostics)


def _local_weights(stack: Stack, spec: TangentSpec, params: dict, batch: dict, key: jax.Array):
    """Each segment's weight-perturbed estimate of its local loss (the segment kernel
    :func:`~jaxstream.grad.segments.local_weight_grad`, as every engine runs it)."""
    example = lambda lg: stack.example_loss(lg, batch)

    def kernel(fn, p, seg):
        return sg.local_grad(stack, fn, p, spec, key, seg, params["head"], example, weights=True)

    logits, grads = sg.segment_sweep(stack, params, batch["x"], kernel)
    return jnp.mean(example(logits)), grads


def local_forward_weights(num_tangents: int = 1,
                          distribution: Distribution = "rademacher") -> LocalForwardWeights:
    """LG-FG-W: each module's weights follow a forward gradient of its own local loss.

    Module m (embed, block l) gets tangents v on its weights only (key schedule of
    :mod:`jaxstream.grad.tangents`) and the estimate (1/K) Σ_k (∇_m ℓ_m·v_k) v_k of its local
    loss ℓ_m = loss(head(h_m)) with the head held fixed; the head's estimate uses the global
    loss. Biased for the global loss (greedy), far less noisy than global weight perturbation.

    Example:
      >>> loss, grads = local_forward_weights(num_tangents=4)(stack, params, batch, key)
    """
    return LocalForwardWeights(TangentSpec(num_tangents, distribution))
