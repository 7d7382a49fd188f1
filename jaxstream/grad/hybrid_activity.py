"""Hybrid with an activity-perturbed forward part, combined per layer with the exact subset.

A step has N micro-batches; a random subset S (k of them, the hybrid's selection) gets exact
gradients g_s with mean h; every other micro-batch n gets an activity-perturbation forward
estimate a_n (:func:`~jaxstream.grad.forward` with ``perturb="activations"``, key
``micro_key(key, n)``). Both h and ā_U = mean_{n∉S} a_n estimate the mean gradient G_U of the
unselected micro-batches, independently:

* h with error variance V_h ≈ σ² (1/k + 1/(N−k)), σ² the spread of micro-batch gradients,
  estimated as Σ_s ‖g_s − h‖² / (k − 1);
* ā_U with error variance V_a ≈ e / (N − k), e the noise of one forward estimate, measured on
  the selected micro-batches where the truth is known: e = mean_s ‖a_s − g_s‖².

Per segment (embed, each block, head) the two are mixed with inverse-variance weights,
α = V_h / (V_h + V_a), and ĝ = (k/N) h + ((N−k)/N) ((1 − α) h + α ā_U). With α ≡ 1 this is the
unbiased ``replace`` hybrid with an activity-perturbed forward part; with α ≡ 0 it is the
exact-subset mean. α is estimated from the same step's data, so the estimate is slightly biased.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

from jaxstream.grad.baselines import select_exact
from jaxstream.grad.estimators import forward
from jaxstream.grad.hybrid import micro_batches_of
from jaxstream.grad.plan import Plan
from jaxstream.grad.tangents import TangentSpec, micro_key
from jaxstream.models.sequential import fold_rng
from jaxstream.models.stack import AS_STACK, Stack

Shrinkage = Literal["per_layer", "global", "none"]
SHRINKAGES = ("per_layer", "global", "none")


def _scale_segments(tree: dict, a: dict) -> dict:
    """Multiply each segment of a stack-shaped tree by its weight (blocks: per layer)."""
    blocks = jax.tree.map(lambda x: x * a["blocks"].reshape((-1,) + (1,) * (x.ndim - 1)),
                          tree["blocks"])
    return {"embed": jax.tree.map(lambda x: a["embed"] * x, tree["embed"]), "blocks": blocks,
            "head": jax.tree.map(lambda x: a["head"] * x, tree["head"])}


def segment_dots(x: dict, y: dict) -> dict:
    """Σ x·y per segment of two stack-shaped trees: ``{"embed": (), "blocks": (L,), "head": ()}``."""
    def total(a, b, keep):
        return sum(jnp.sum((u * v).reshape(u.shape[:keep] + (-1,)), axis=-1)
                   for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    return {"embed": total(x["embed"], y["embed"], 0), "blocks": total(x["blocks"], y["blocks"], 1),
            "head": total(x["head"], y["head"], 0)}


def mixing_weights(spread: dict, noise: dict, k: int, n: int, shrinkage: str) -> dict:
    """α per segment from the exact gradients' spread Σ_s ‖g_s − h‖² and the forward estimates'
    noise Σ_s ‖a_s − g_s‖² on the k selected micro-batches (per segment); see the module
    docstring."""
    if shrinkage == "global":
        spread = {s: sum(jnp.sum(v) for v in spread.values()) for s in spread}
        noise = {s: sum(jnp.sum(v) for v in noise.values()) for s in noise}
    v_h = {s: v / (k - 1) * (1.0 / k + 1.0 / (n - k)) for s, v in spread.items()}
    v_a = {s: v / k / (n - k) for s, v in noise.items()}
    return {s: v_h[s] / jnp.maximum(v_h[s] + v_a[s], 1e-30) for s in v_h}


@dataclasses.dataclass(frozen=True)
class HybridActivity:
    """Exact subset + activity-perturbed forward part, mixed per layer (see
    :func:`hybrid_activity`)."""

    num_exact: int = 2
    num_tangents: int = 1
    shrinkage: Shrinkage = "per_layer"

    def __post_init__(self):
        if not isinstance(self.num_exact, int) or self.num_exact < 2:
            raise ValueError(f"num_exact must be an int >= 2 (the spread of the exact gradients "
                             f"needs two), got {self.num_exact!r}")
        if self.shrinkage not in SHRINKAGES:
            raise ValueError(f"shrinkage must be one of {SHRINKAGES}, got {self.shrinkage!r}")

    @property
    def plan(self) -> Plan:
        """Activity tangents for every micro-batch, exact gradients for the selection, mixed by
        this estimator's per-layer inverse-variance weights (in memory only)."""
        return Plan("activity", "selected", None, TangentSpec(self.num_tangents),
                    micro_batches=True, select=self.selection, num_exact=self.num_exact)

    def selection(self, n: int, key: jax.Array, num_layers: int | None = None):
        """(indices, depth): the hybrid's random selection for the same key."""
        return select_exact(key, n, self.num_exact), jnp.zeros((self.num_exact,), jnp.int32)

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array,
                 *, diagnostics: bool = False):
        if not isinstance(loss_fn, Stack):
            raise TypeError("hybrid_activity needs a model Stack as loss_fn (activity "
                            f"perturbation); got {type(loss_fn).__name__}" + AS_STACK)
        n = micro_batches_of(batch)
        if n <= self.num_exact:
            raise ValueError(f"hybrid_activity: num_exact={self.num_exact} must be below the "
                             f"N={n} micro-batches")
        k = self.num_exact
        idx = select_exact(key, n, k)
        est = forward(num_tangents=self.num_tangents, perturb="activations")
        keys = jax.vmap(lambda i: micro_key(key, i))(jnp.arange(n))
        unselected = jnp.ones((n,)).at[idx].set(0.0) / (n - k)
        # micro-batch n's model randomness, if any: fold_rng(loss_fn, n) in every pass
        losses, a_u = _forward_sums(lambda b, kk, i: est(fold_rng(loss_fn, i), params, b, kk),
                                    batch, keys, unselected, params)
        # The selected micro-batches one after another: each exact gradient beside its forward
        # estimate (drawn again from the same key), folded into h and the per-segment spread
        # and noise (Welford), so one gradient tree of each is live, not k.
        h, spread, noise = _exact_sums(
            lambda b, i: jax.grad(fold_rng(loss_fn, i))(params, b),
            lambda b, kk, i: est(fold_rng(loss_fn, i), params, b, kk)[1],
            jax.tree.map(lambda x: jnp.asarray(x)[idx], batch), keys[idx], idx, params)
        if self.shrinkage == "none":
            alpha = {"embed": jnp.float32(1.0), "blocks": jnp.ones((loss_fn.num_layers,)),
                     "head": jnp.float32(1.0)}
        else:
            alpha = mixing_weights(spread, noise, k, n, self.shrinkage)
        # ĝ = (k/N) h + ((N−k)/N) (h + α (ā_U − h)) = h + ((N−k)/N) α (ā_U − h)
        grads = jax.tree.map(lambda hh, d: hh + (n - k) / n * d, h,
                             _scale_segments(jax.tree.map(lambda a, hh: a - hh, a_u, h), alpha))
        diag = {"alpha": alpha, "exact_indices": idx}
        return (jnp.mean(losses), grads, diag) if diagnostics else (jnp.mean(losses), grads)


def _forward_sums(fn: Callable, batch: Any, keys: jax.Array, weights: jax.Array,
                  like: Any) -> tuple[jax.Array, Any]:
    """The N forward estimates ``fn(micro_batch, key, n)`` one after another, never all at
    once: (losses (N,), Σ_n weights[n] a_n). Each estimate is a whole gradient tree, so
    micro-batches run one by one (a chunk of them would hold a tree each)."""

    def body(acc, xs):
        b, kk, w, i = xs
        loss, a = fn(b, kk, i)
        return jax.tree.map(lambda s, x: s + (w * x).astype(s.dtype), acc, a), loss

    a_sum, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, like),
                                 (batch, keys, weights, jnp.arange(keys.shape[0])))
    return losses, a_sum


def _exact_sums(grad: Callable, fwd: Callable, batch: Any, keys: jax.Array, idx: jax.Array,
                like: Any) -> tuple[Any, dict, dict]:
    """Over the selected micro-batches ``idx`` one after another (``grad(b, n)``,
    ``fwd(b, key, n)``): (h = the mean exact gradient, Σ_s ‖g_s − h‖² per segment by
    Welford's update, Σ_s ‖a_s − g_s‖² per segment)."""
    zero = jax.tree.map(jnp.zeros_like, like)
    seg0 = segment_dots(zero, zero)

    def body(carry, xs):
        mean, m2, noise, count = carry
        b, kk, i = xs
        g, a = grad(b, i), fwd(b, kk, i)
        count = count + 1.0
        delta = jax.tree.map(lambda x, m: x - m, g, mean)
        mean = jax.tree.map(lambda m, d: m + d / count, mean, delta)
        m2 = jax.tree.map(jnp.add, m2, segment_dots(delta, jax.tree.map(jnp.subtract, g, mean)))
        diff = jax.tree.map(jnp.subtract, a, g)
        noise = jax.tree.map(jnp.add, noise, segment_dots(diff, diff))
        return (mean, m2, noise, count), None

    (h, spread, noise, _), _ = jax.lax.scan(body, (zero, seg0, seg0, jnp.float32(0.0)),
                                            (batch, keys, idx))
    return h, spread, noise


def hybrid_activity(num_exact: int = 2, num_tangents: int = 1,
                    shrinkage: str = "per_layer") -> HybridActivity:
    """Exact gradients of ``num_exact`` micro-batches and activity-perturbed forward estimates
    of the rest, mixed per segment by estimated inverse variances.

    Args:
      num_exact: k >= 2 exact micro-batches (the hybrid's random selection for the same key).
      num_tangents: activity tangents per micro-batch.
      shrinkage: ``"per_layer"`` (α per embed / block / head), ``"global"`` (one α) or
        ``"none"`` (α = 1: exact where known, forward elsewhere; unbiased).

    Example:
      >>> micro = jax.tree.map(lambda x: x.reshape(8, -1, *x.shape[1:]), batch)
      >>> loss, grads = hybrid_activity(2)(stack, params, micro, key)
    """
    return HybridActivity(num_exact, num_tangents, shrinkage)
