"""Gradient estimators with one signature: ``estimator(loss_fn, params, batch, key)``.

Each returns ``(loss, grads)`` (``grads`` shaped like ``params``), or ``(loss, grads, diag)``
with ``diagnostics=True``. Estimators are frozen dataclasses: hashable, so they can be closed
over or passed as static arguments to ``jax.jit``; the call itself is pure and vmappable over
``key``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax

from jaxstream.grad import combine as cb
from jaxstream.grad.checks import (
    check_examples,
    check_inputs,
    check_key,
    check_labels,
    check_local_losses,
)
from jaxstream.grad.directional import directional, stack_activity
from jaxstream.grad.layered import is_layered, layered_activity
from jaxstream.grad.plan import Plan
from jaxstream.grad.tangents import Distribution, TangentSpec
from jaxstream.models.stack import AS_STACK, Stack

Aggregation = Literal["mean", "projection"]
Perturb = Literal["weights", "activations"]


def _finish(loss, grads, diag, diagnostics: bool):
    return (loss, grads, diag) if diagnostics else (loss, grads)


@dataclasses.dataclass(frozen=True)
class Backprop:
    """Exact gradient by reverse mode (``jax.value_and_grad``): the reference."""

    plan = Plan("none", "all")

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array | None = None,
                 *, diagnostics: bool = False):
        """``key`` is accepted (and unused) so every estimator has one signature."""
        if key is not None:
            check_key(key, "backprop")
        check_labels(loss_fn, batch, "backprop")
        check_inputs(loss_fn, params, batch, "backprop")
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return _finish(loss, grads, {}, diagnostics)


def coefficients(spec: TangentSpec, aggregation: str, d: jax.Array,
                 gram_fn: Callable[[], jax.Array]) -> jax.Array:
    """The K coefficients c of an estimate Σ_k c_k v_k from the directional derivatives ``d``
    of one micro-batch, by the aggregation's combine rule (:mod:`jaxstream.grad.combine`):
    ``mean``: d / K (unbiased); ``projection``: (VᵀV)⁻¹ d (|cos| ≈ √(K/n), biased: E ĝ ≈
    (K/n) g). ``gram_fn()`` gives VᵀV summed over every segment (called only where the rule
    needs it)."""
    rule = cb.get(aggregation)
    stats = cb.Stats(spec, None, d[None], None)
    totals = {"gram": gram_fn()[None]} if rule.cross else {}
    return rule.coefficients(stats, totals)[0]


def aggregate(spec: TangentSpec, aggregation: str, key: jax.Array, params: Any,
              d: jax.Array) -> Any:
    """Form the estimate from the directional derivatives ``d`` (K,) of one micro-batch by the
    aggregation's combine rule."""
    return cb.combine(aggregation, cb.Stats(spec, key[None], d[None], params))


@dataclasses.dataclass(frozen=True)
class Forward:
    """Forward-gradient estimator (see :func:`forward`)."""

    spec: TangentSpec = TangentSpec()
    perturb: Perturb = "weights"
    aggregation: Aggregation = "mean"
    local_losses: bool = False

    def __post_init__(self):
        if self.perturb not in ("weights", "activations"):
            raise ValueError(f"perturb must be 'weights' or 'activations', got {self.perturb!r}")
        if self.aggregation not in ("mean", "projection"):
            raise ValueError(
                f"aggregation must be 'mean' or 'projection', got {self.aggregation!r}"
            )
        if self.perturb == "activations" and self.aggregation != "mean":
            raise ValueError("aggregation='projection' needs perturb='weights'")
        if self.local_losses and self.perturb != "activations":
            raise ValueError("local_losses=True needs perturb='activations' (weight tangents on "
                             "local losses are LG-FG-W: jaxstream.grad.local_forward_weights())")
        if self.spec.rank is not None and self.perturb != "weights":
            raise ValueError(f"rank={self.spec.rank}: low-rank tangents are for weight matrices; "
                             "allowed: perturb='weights' with rank, or rank=None")

    @property
    def plan(self) -> Plan:
        """Weight tangents combined by the aggregation, or an activity / local-loss pass that
        forms each block's estimate itself."""
        if self.perturb == "weights":
            return Plan("weights", "none", self.aggregation, self.spec)
        return Plan("local" if self.local_losses else "activity", "none", None, self.spec)

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array | None = None,
                 *, diagnostics: bool = False):
        check_key(key, "forward")
        check_labels(loss_fn, batch, "forward")
        if isinstance(loss_fn, Stack):
            check_examples(batch, "forward")
            check_local_losses(loss_fn, self.local_losses, "forward")
        check_inputs(loss_fn, params, batch, "forward")
        if self.perturb == "activations":
            if is_layered(loss_fn):  # a user's layered model (models.from_sequential)
                if self.local_losses:
                    raise ValueError("local_losses=True needs a model Stack (a shared head for "
                                     f"every block); got {type(loss_fn).__name__}" + AS_STACK)
                loss, grads = layered_activity(loss_fn, self.spec, params, batch, key)
                return _finish(loss, grads, {}, diagnostics)
            if not isinstance(loss_fn, Stack):
                raise TypeError(
                    "perturb='activations' needs a model Stack or a layered model "
                    "(jaxstream.models.from_sequential) as loss_fn (it perturbs each "
                    f"block's outputs); got {type(loss_fn).__name__}"
                )
            loss, grads = stack_activity(loss_fn, self.spec, params, batch, key, self.local_losses)
            return _finish(loss, grads, {}, diagnostics)
        loss, d = directional(loss_fn, self.spec, params, batch, key)
        grads = aggregate(self.spec, self.aggregation, key, params, d)
        return _finish(loss, grads, {"directional": d}, diagnostics)


def backprop() -> Backprop:
    """The exact gradient by reverse mode, as an estimator.

    Example:
      >>> loss, grads = backprop()(stack, params, batch, key)
    """
    return Backprop()


def forward(
    num_tangents: int = 1,
    distribution: Distribution = "rademacher",
    perturb: Perturb = "weights",
    orthogonal: bool = False,
    antithetic: bool = False,
    aggregation: Aggregation = "mean",
    local_losses: bool = False,
    rank: int | None = None,
) -> Forward:
    """Forward-gradient estimator: ĝ = (1/K) Σ_k (∇L·v_k) v_k with E[v vᵀ] = I.

    Args:
      num_tangents: K, tangents per step.
      distribution: ``"rademacher"`` or ``"gaussian"``.
      perturb: ``"weights"`` (tangents on parameters) or ``"activations"`` (tangents on each
        block's outputs; weight estimates formed locally per block; needs a Stack).
      orthogonal: orthogonalise the K tangents (per leaf).
      antithetic: use ±v pairs (even K).
      aggregation: ``"mean"`` (unbiased) or ``"projection"`` onto the span of the tangents:
        V (VᵀV)⁻¹ Vᵀ g, biased — E ĝ ≈ (K/n) g for n parameters (its norm shrinks by about
        K/n), with a higher cosine to g than the mean for the same K.
      local_losses: with ``perturb="activations"``, give each block its own loss.
      rank: low-rank weight tangents (None: full ones): each 2-D leaf (m, n) gets
        v = A Bᵀ / √r, A (m, r) and B (n, r) drawn by ``distribution``; other leaves full
        tangents. E[v vᵀ] = I still, so the mean stays unbiased (:class:`TangentSpec`).
        Needs ``perturb="weights"`` and ``orthogonal=False``.

    Returns:
      An estimator ``(loss_fn, params, batch, key) -> (loss, grads)``.

    Same key, another form of the model: tangents are drawn per parameter group of the loss
    function they are given — per layer of a :class:`~jaxstream.models.Sequential`, per embed /
    block / head of a :class:`~jaxstream.models.Stack`. So on a stack view of a user's model
    (``as_stack``, ``as_padded_stack``) the estimate has the same distribution as on the model
    itself but other draws for the same key (relative differences of order one): compare an
    engine with the in-memory estimator on ``view.stack``, never on the model.

    Example:
      >>> est = forward(num_tangents=4, distribution="gaussian")
      >>> loss, grads = jax.jit(est, static_argnums=0)(stack, params, batch, key)
      >>> low_rank = forward(num_tangents=4, distribution="gaussian", rank=2)
    """
    spec = TangentSpec(num_tangents, distribution, orthogonal, antithetic, rank)
    return Forward(spec, perturb, aggregation, local_losses)
