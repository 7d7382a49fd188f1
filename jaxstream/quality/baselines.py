"""The two ingredients of a hybrid estimate, as estimators of the mean micro-batch gradient.

A hybrid step combines (a) forward estimates on every micro-batch and (b) exact gradients of a
subset S. To judge a correction, compare it with each ingredient alone:

* :class:`MicrobatchForward` — ``(1/N) Σ_n (1/K) Σ_k d_nk v_nk``, the forward part (unbiased),
  with micro-batch ``n`` keyed ``fold_in(key, n)`` as in the hybrid estimators;
* :class:`ExactSubset` — ``h = (1/|S|) Σ_{s∈S} g_s``, the exact-subset mean (biased: it is the
  gradient of S only).

Both take a batch with a leading micro-batch axis N, like ``jaxstream.grad.hybrid``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad.hybrid import SELECT


def _micro_batches_of(batch: Any) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


@dataclasses.dataclass(frozen=True)
class MicrobatchForward:
    """Mean over micro-batches of a forward estimator's estimates (own key per micro-batch).

    Attributes:
      forward: a forward estimator, e.g. ``jaxstream.grad.forward(num_tangents=1)``.

    Example:
      >>> est = MicrobatchForward(jg.forward())
      >>> loss, grads = est(stack, params, microbatched_batch, key)
    """

    forward: Callable[..., Any]

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array):
        n = _micro_batches_of(batch)

        def one(i, mb):
            return self.forward(loss_fn, params, mb, jax.random.fold_in(key, i))

        losses, grads = jax.vmap(one)(jnp.arange(n), batch)
        return jnp.mean(losses), jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)


@dataclasses.dataclass(frozen=True)
class ExactSubset:
    """Mean exact gradient of a subset of micro-batches: the hybrid's ``h`` alone.

    Give either ``num_exact`` (a random subset drawn from the key exactly as
    ``jaxstream.grad.hybrid(num_exact=...)`` draws it, so both see the same subset for the same
    key) or fixed ``indices``.

    Example:
      >>> loss, h = ExactSubset(num_exact=2)(stack, params, microbatched_batch, key)
    """

    num_exact: int | None = None
    indices: tuple[int, ...] | None = None

    def __post_init__(self):
        if (self.num_exact is None) == (self.indices is None):
            raise ValueError("ExactSubset: give exactly one of num_exact, indices")
        if self.num_exact is not None and self.num_exact < 1:
            raise ValueError(f"num_exact: must be >= 1, got {self.num_exact}")
        if self.indices is not None and not self.indices:
            raise ValueError("indices: the exact subset must hold at least one micro-batch")

    def _indices(self, n: int, key: jax.Array | None) -> jax.Array:
        if self.indices is not None:
            if max(self.indices) >= n or min(self.indices) < 0:
                raise ValueError(f"indices: {self.indices} out of range for {n} micro-batches")
            return jnp.asarray(self.indices)
        if self.num_exact > n:
            raise ValueError(f"num_exact: {self.num_exact} exceeds the {n} micro-batches")
        if key is None:
            raise ValueError("ExactSubset(num_exact=...) draws its subset from the key; give one")
        return jax.random.choice(
            jax.random.fold_in(key, SELECT), n, (self.num_exact,), replace=False
        )

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array | None = None):
        sel = jax.tree.map(lambda a: a[self._indices(_micro_batches_of(batch), key)], batch)

        def mean_loss(p):
            return jnp.mean(jax.vmap(lambda mb: loss_fn(p, mb))(sel))

        return jax.value_and_grad(mean_loss)(params)
