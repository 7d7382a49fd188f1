"""Zeroth-order gradient estimates (SPSA, MeZO): two loss evaluations per direction, no jvp.

Direction k of a step keyed ``key`` is the one tangent of ``fold_in(key, k)`` under the key
schedule of :mod:`.tangents` (``tangents(TangentSpec(1, distribution, rank=rank),
fold_in(key, k), params)``): the directions are drawn one at a time, never K at once. For a
:class:`~jaxstream.models.Stack` each segment's perturbation θ_s ± ε v_s is drawn inside the
pass (the scan over blocks), so a step costs the memory of inference: the parameters plus one
layer's direction (MeZO's in-place perturbation, without the rounding drift of adding εv and
subtracting it again). Any other loss function gets one direction materialised at a time. The
estimate Σ_k c_k v_k is formed by :func:`jaxstream.grad.combine.combine`, which regenerates the
directions per segment.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.random import fold_in

from jaxstream.grad import combine as cb
from jaxstream.grad.checks import check_examples, check_inputs, check_key, check_labels
from jaxstream.grad.plan import Plan
from jaxstream.grad.segments import segment_key
from jaxstream.grad.tangents import (
    DISTRIBUTIONS,
    Distribution,
    TangentSpec,
    block_key,
    leaf_tangents,
    tangents,
)
from jaxstream.grad.threefry import tied
from jaxstream.models.stack import Stack, loss_dtype


def _f32(x: Any) -> Any:
    """A leaf as the draws see it: tangents are drawn in float32 whatever the leaf's dtype (the
    combine draws them so), so bf16 params get the directions of their fp32 master."""
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32)


def _add(p: Any, v: Any, sign: jax.Array, eps: float) -> Any:
    """``p + sign · eps · v[0]``, summed in at least float32 (ε in float64 for float64 params),
    each leaf returned in its own dtype."""
    def add(x, vv):
        acc = loss_dtype(x.dtype)
        return (x.astype(acc) + (sign.astype(acc) * eps) * vv[0].astype(acc)).astype(x.dtype)

    return jax.tree.map(add, p, v)


def _stack_loss(stack: Stack, spec: TangentSpec, params: dict, batch: dict, key: jax.Array,
                sign: jax.Array, eps: float) -> jax.Array:
    """L(θ + sign · ε v) of a stack, each segment's share of v drawn where the segment runs
    (one layer's direction live at a time)."""
    def shift(p, k):
        return _add(p, leaf_tangents(spec, k, jax.tree.map(_f32, p)), sign, eps)

    h = stack.embed(shift(params["embed"], segment_key(key, "embed")), batch["x"])

    def body(h, xs):
        p, layer = xs
        return stack.block(shift(p, block_key(tied(key, h), layer)), h), None

    n = jax.tree.leaves(params["blocks"])[0].shape[0]
    h, _ = jax.lax.scan(body, h, (params["blocks"], jnp.arange(n)))
    logits = stack.head(shift(params["head"], segment_key(tied(key, h), "head")), h)
    return jnp.mean(stack.example_loss(logits.astype(loss_dtype(logits.dtype)), batch))


def _generic_loss(loss_fn: Callable, spec: TangentSpec, params: Any, batch: Any,
                  key: jax.Array, sign: jax.Array, eps: float) -> jax.Array:
    """L(θ + sign · ε v) of any loss function (the one direction materialised)."""
    wide = jax.tree.map(lambda x: x if jnp.finfo(x.dtype).bits >= 32 else x.astype(jnp.float32),
                        params)
    v = jax.tree.map(lambda t: t.astype(jnp.float32), tangents(spec, key, wide))
    return loss_fn(_add(params, v, sign, eps), batch)


def two_point(loss_fn: Callable, spec: TangentSpec, eps: float, params: Any, batch: Any,
              keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(L(θ + ε v_k), L(θ − ε v_k))`` for each direction key of ``keys`` (K,): two arrays
    (K,). The 2K passes run one after the other (one ``lax.map``, one compiled pass; each
    draws its direction again), so the peak is one pass's: a model stack holds the parameters,
    one layer's direction and one batch's activations."""
    one = _stack_loss if isinstance(loss_fn, Stack) else _generic_loss
    num = keys.shape[0]
    pairs = (jnp.repeat(keys, 2, axis=0), jnp.tile(jnp.array([1, -1], jnp.int8), num))
    both = jax.lax.map(lambda ks: one(loss_fn, spec, params, batch, ks[0], ks[1], eps), pairs)
    both = both.reshape(num, 2)
    return both[:, 0], both[:, 1]


def direction_keys(key: jax.Array, num: int) -> jax.Array:
    """Key of direction k: ``fold_in(key, k)``, k < num."""
    return jax.vmap(lambda k: fold_in(key, k))(jnp.arange(num))


@dataclasses.dataclass(frozen=True)
class SPSA:
    """Zeroth-order two-point estimator (see :func:`spsa`).

    Attributes:
      spec: the directions: ``spec.num`` = K, their distribution and rank.
      eps: ε, the perturbation's size.
    """

    spec: TangentSpec = dataclasses.field(default_factory=TangentSpec)
    eps: float = 1e-3

    def __post_init__(self):
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) \
                or eps <= 0:
            raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
        if self.spec.orthogonal:
            raise ValueError("orthogonal=True: spsa draws each direction from its own key; "
                             "allowed: orthogonal=False")

    @property
    def plan(self) -> Plan:
        """A zeroth-order pass (no jvp) that forms the estimate itself: engines that run only
        jvp sweeps refuse it by name."""
        return Plan("zeroth_order", "none", None, self.spec)

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array | None = None,
                 *, diagnostics: bool = False):
        check_key(key, "spsa")
        check_labels(loss_fn, batch, "spsa")
        if isinstance(loss_fn, Stack):
            check_examples(batch, "spsa")
        check_inputs(loss_fn, params, batch, "spsa")
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        one = dataclasses.replace(self.spec, num=1)
        keys = direction_keys(key, self.spec.num)
        plus, minus = two_point(loss_fn, one, self.eps, params, batch, keys)
        d = (plus - minus) / (2.0 * self.eps)  # (K,) central differences ≈ ∇L·v_k
        grads = cb.combine("mean", cb.Stats(one, keys, d[:, None], params))
        loss = jnp.mean((plus + minus) / 2.0)  # L(θ) + O(ε²): no third pass
        return (loss, grads, {"directional": d}) if diagnostics else (loss, grads)


def spsa(num_directions: int = 1, eps: float = 1e-3, distribution: Distribution = "rademacher",
         rank: int | None = None) -> SPSA:
    """Zeroth-order (SPSA / MeZO) estimator: ĝ = (1/K) Σ_k (L(θ+εv_k) − L(θ−εv_k)) / (2ε) · v_k.

    Two loss evaluations per direction and no jvp, at the memory of inference: direction k is
    the tangent of ``fold_in(key, k)`` (:mod:`jaxstream.grad.tangents`), regenerated where it
    is used (θ ± εv_k formed segment by segment for a model stack), never K of them at once;
    the 2K passes run one after the other.

    With E[v vᵀ] = I, (L(θ+εv) − L(θ−εv)) / (2ε) = ∇L·v + (ε²/6) ∇³L[v, v, v] + O(ε⁴), so
    E ĝ = ∇L + (ε²/6) E[∇³L[v, v, v] v] + O(ε⁴): biased by O(ε²) (the third derivative's
    term; zero for a quadratic loss), with the variance of the forward gradient (∇L·v) v
    otherwise. Rounding: a loss difference in float32 carries an error of about
    ε₃₂ L / ε in each (∇L·v) (ε₃₂ ≈ 1.2e-7), so keep ε well above the loss's resolution
    (1e-3 is MeZO's choice) and the parameters in float32 or wider (θ ± εv is formed in at
    least float32 but stored back in the parameters' dtype: bf16 would round εv away).

    Args:
      num_directions: K, directions per step (2K loss evaluations).
      eps: ε > 0, the perturbation's size.
      distribution: ``"rademacher"`` or ``"gaussian"`` directions.
      rank: low-rank directions (None: full ones): v = A Bᵀ / √r on each 2-D leaf, full
        directions on the others (:class:`~jaxstream.grad.tangents.TangentSpec`).

    Returns:
      An estimator ``(loss_fn, params, batch, key) -> (loss, grads)``; ``loss`` is the mean of
      (L(θ+εv_k) + L(θ−εv_k)) / 2, which is L(θ) + O(ε²).

    Example:
      >>> est = spsa(num_directions=4, eps=1e-3)
      >>> loss, grads = jax.jit(est, static_argnums=0)(stack, params, batch, key)
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if isinstance(num_directions, bool) or not isinstance(num_directions, int) \
            or num_directions < 1:
        raise ValueError(f"num_directions must be an int >= 1, got {num_directions!r}")
    return SPSA(TangentSpec(num_directions, distribution, rank=rank), eps)
