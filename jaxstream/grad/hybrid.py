"""Hybrid estimator: forward estimates for every micro-batch, exact gradients for a subset."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.grad import combine as cb
from jaxstream.grad import corrections as cr
from jaxstream.grad.checks import check_inputs, check_key, check_labels, check_micro_batches
from jaxstream.grad.directional import directional
from jaxstream.grad.estimators import _finish
from jaxstream.grad.exact import group_exact_mean
from jaxstream.grad.plan import Plan
from jaxstream.grad.tangents import Distribution, TangentSpec, micro_key
from jaxstream.models.sequential import fold_rng
from jaxstream.models.stack import Stack

SELECT = 0x7FFFFFFF  # key segment of the random choice of exact micro-batches
# Micro-batches whose forward passes run together (vmapped) in a hybrid step; the chunks run one
# after another. benchmarks/memory_time.py --parts times chunks of this size against all N at
# once and one at a time.
FORWARD_CHUNK = 4


def micro_batches_of(batch: Any) -> int:
    """N, the common leading axis of every leaf of ``batch`` (N, B, ...); a clear error
    naming the leaf otherwise."""
    return check_micro_batches(batch, "hybrid")


@dataclasses.dataclass(frozen=True)
class Hybrid:
    """Forward estimates for N micro-batches, corrected by exact gradients (see :func:`hybrid`)."""

    spec: TangentSpec = TangentSpec()
    correction: str = "control_variate"
    num_exact: int | None = 1
    exact_indices: tuple[int, ...] | None = None
    exact_from: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.correction not in cb.corrections():
            raise ValueError(
                f"correction must be one of {cb.corrections()}, got {self.correction!r}"
            )
        given = [x is not None for x in (self.num_exact, self.exact_indices, self.exact_from)]
        if sum(given) != 1:
            raise ValueError("hybrid: give exactly one of num_exact, exact_indices, exact_from")
        if self.num_exact is not None and (not isinstance(self.num_exact, int) or self.num_exact < 1):
            raise ValueError(f"num_exact must be an int >= 1, got {self.num_exact!r}")
        if self.exact_indices is not None and (
                len(self.exact_indices) == 0 or len(set(self.exact_indices)) != len(self.exact_indices)):
                raise ValueError(f"exact_indices must be distinct and non-empty, got {self.exact_indices}")

    @property
    def plan(self) -> Plan:
        """Weight tangents for every micro-batch, exact gradients for the selection, combined
        by the correction's rule."""
        return Plan("weights", "selected", self.correction, self.spec, micro_batches=True,
                    select=self.selection, num_exact=self.num_exact or (
                        len(self.exact_indices) if self.exact_indices is not None else None),
                    fixed=self.exact_indices, nested=self.exact_from is not None)

    def selection(self, n: int, key: jax.Array, num_layers: int | None) -> tuple[jax.Array, jax.Array]:
        """(indices, depth) of the micro-batches with an exact gradient, the same in every
        engine; checked before compute. ``num_layers``: the stack's depth (None: not a stack).
        ``depth[i]`` is the first block with micro-batch ``indices[i]``'s exact gradient."""
        if self.num_exact is not None:
            if self.num_exact > n:
                raise ValueError(f"num_exact={self.num_exact} exceeds the N={n} micro-batches")
            idx = jax.random.choice(jax.random.fold_in(key, SELECT), n, (self.num_exact,), replace=False)
            return idx, jnp.zeros((self.num_exact,), jnp.int32)
        if self.exact_indices is not None:
            bad = [i for i in self.exact_indices if not 0 <= i < n]
            if bad:
                raise ValueError(f"exact_indices {bad} out of range for N={n} micro-batches")
            k = len(self.exact_indices)
            return jnp.array(self.exact_indices, jnp.int32), jnp.zeros((k,), jnp.int32)
        if num_layers is None:
            raise TypeError("exact_from (per-layer groups) needs a model Stack as loss_fn")
        if len(self.exact_from) != n or not all(0 <= f <= num_layers + 1 for f in self.exact_from):
            raise ValueError(
                f"exact_from must give, for each of the N={n} micro-batches, the first block "
                f"with an exact gradient in 0..{num_layers} (or {num_layers + 1} for none); "
                f"got {self.exact_from}"
            )
        sel = [i for i, f in enumerate(self.exact_from) if f <= num_layers]
        if not sel:
            raise ValueError("exact_from selects no micro-batch (every entry is L + 1)")
        depth = np.array([self.exact_from[i] for i in sel], np.int32)
        return jnp.array(sel, jnp.int32), jnp.array(depth)

    def __call__(self, loss_fn: Callable, params: Any, batch: Any, key: jax.Array | None = None,
                 *, diagnostics: bool = False, guess: Any = None,
                 reduce: Callable[[Any], Any] | None = None):
        """``reduce``: applied to the per-micro-batch quantities (losses, directional
        derivatives, exact gradients, guess derivatives) before any correction is formed — a
        data-parallel engine passes a mean over its replicas (each holding a shard of every
        micro-batch, tangents shared), so every correction, nonlinear ones included, equals the
        estimator on the whole batch."""
        reduce = reduce or (lambda t: t)
        check_key(key, "hybrid")
        n = micro_batches_of(batch)
        check_labels(loss_fn, batch, "hybrid")
        check_inputs(loss_fn, params, batch, "hybrid", micro=True)
        idx, depth = self.selection(n, key, loss_fn.num_layers if isinstance(loss_fn, Stack) else None)
        spec, rule = self.spec, cb.get(self.correction)
        keys = jax.vmap(lambda i: micro_key(key, i))(jnp.arange(n))
        masks = cr.group_masks(params, depth)
        # The exact part first, at one rematerialised backprop's memory; h reduced (a linear
        # mean over replicas) before the forward pass, which then sums the residual scalars
        # c = h·v as it draws its tangents.
        # Micro-batch n draws the model's randomness from fold_rng(loss_fn, n) in every pass.
        h, counts, _ = group_exact_mean(loss_fn, params, jax.tree.map(lambda x: jnp.asarray(x)[idx], batch),
                                        masks, idx)
        h = reduce(h)
        probe = h if rule.residual else None
        out = forward_chunks(
            lambda b, k, i: directional(fold_rng(loss_fn, i), spec, params, b, k, probe),
            batch, keys)
        losses, d = reduce(out[:2])
        totals = {"c": out[2]} if rule.residual else None
        rows = cr.outside_rows(masks, idx, n)
        diag: dict = {"directional": d, "exact_indices": idx}
        stats = cb.Stats(spec, keys, d, params, h=h, counts=counts, rows=rows,
                         outside=rows["head"] if "head" in rows else rows["tree"])
        if rule.along:  # differentiate along the direction instead of the tangents
            u = cb.unit_direction(h if guess is None else guess)
            dg = reduce(forward_chunks(
                lambda b, _k, i: jax.jvp(lambda p: fold_rng(loss_fn, i)(p, b), (params,), (u,))[1],
                batch, keys))
            stats = stats._replace(d=dg[:, None], direction=u)
            diag["guess_directional"] = dg
        grads, chosen = cb.combine(rule, stats, diagnostics=True, totals=totals)
        diag.update(chosen)
        return _finish(jnp.mean(losses), grads, diag, diagnostics)


def forward_chunks(fn: Callable, batch: Any, keys: jax.Array) -> Any:
    """``fn(micro_batch, key, n)`` for every micro-batch n: ``FORWARD_CHUNK`` of them at a time
    under ``jax.vmap``, the chunks one after another (``lax.map``), so only that many
    micro-batches' tangents are live (all N at once hold N tangents of the largest layer)."""
    n = jnp.arange(keys.shape[0])
    return jax.lax.map(lambda bki: fn(*bki), (batch, keys, n), batch_size=FORWARD_CHUNK)


def hybrid(
    num_exact: int | None = None,
    correction: str = "control_variate",
    num_tangents: int = 1,
    distribution: Distribution = "rademacher",
    *,
    exact_indices: tuple[int, ...] | None = None,
    exact_from: tuple[int, ...] | None = None,
    orthogonal: bool = False,
    antithetic: bool = False,
) -> Hybrid:
    """Forward estimates for all N micro-batches, exact gradients (vjp) for a subset.

    ``batch`` leaves carry a leading micro-batch axis N; ``loss_fn`` sees one micro-batch; the
    estimate is of the gradient of the mean loss over the N micro-batches. Micro-batch n's
    tangents use key ``fold_in(key, n)``, and a model with a bound key (dropout) draws its
    randomness for micro-batch n from ``fold_in(model.rng, n)`` in every pass
    (:func:`~jaxstream.models.sequential.fold_rng`).

    Args:
      num_exact: a random subset of this many micro-batches gets exact gradients (default 1).
      correction: ``"replace"`` (exact where available; unbiased), ``"control_variate"``
        (ĝ = h + mean_n mean_k (d_nk − h·v_nk) v_nk with h the mean exact gradient; unbiased),
        ``"weighted"`` (the control variate with its forward part shrunk by a β ∈ [0, 1] fixed by
        N, the group size, K and the model's size; unbiased with a random selection, biased with
        a fixed one, lowest error)
        ``"stein"`` (the control variate with a positive-part James–Stein weight per segment,
        β = max(0, 1 − Var r / ‖r‖²): its ‖r‖² sees a fixed selection's systematic deviation,
        so it is less biased than ``weighted`` there)
        or ``"guess"`` (h, or the ``guess=`` keyword's direction, as the only tangent; biased).
      num_tangents, distribution, orthogonal, antithetic: tangents (see :func:`forward`).
      exact_indices: fixed micro-batches with exact gradients instead of a random subset.
      exact_from: per-layer nested groups, one int per micro-batch: micro-batch n has exact
        gradients for blocks ``>= exact_from[n]`` (0: all, including the embed; L: head only;
        L + 1: none). Needs a Stack.

    Memory: the exact part is one rematerialised sweep over the selected micro-batches
    (:func:`jaxstream.grad.exact.group_exact_mean`), the forward pass runs ``FORWARD_CHUNK``
    micro-batches at a time and sums c = h·v as it draws its tangents, and the estimate is
    added into h's buffer, so a step's temporary memory stays near that of a forward pass
    (``benchmarks/memory_time.py --parts`` measures each part).

    Compute: a jvp along a dense weight tangent is three matrix products per layer (x·W, dx·W,
    x·V), as many as backprop's (x·W, δ·Wᵀ, xᵀ·δ), so the forward part over all N
    micro-batches already costs backprop's FLOPs; the exact part adds its share's
    rematerialised backprop, about (4/3)·k/N of backprop's. At equal FLOP rates the step is
    never faster than backprop (counted by :func:`jaxstream.quality.flops.matmul_flops`).

    Same key, another form of the model: tangents are drawn per parameter group of the loss
    function, as for :func:`~jaxstream.grad.forward` (its docstring says what that means for a
    stack view).

    Example:
      >>> est = hybrid(num_exact=2, correction="control_variate")
      >>> micro = jax.tree.map(lambda x: x.reshape(16, -1, *x.shape[1:]), batch)
      >>> loss, grads = est(stack, params, micro, key)
    """
    if num_exact is None and exact_indices is None and exact_from is None:
        num_exact = 1
    return Hybrid(
        TangentSpec(num_tangents, distribution, orthogonal, antithetic),
        correction,
        num_exact,
        None if exact_indices is None else tuple(int(i) for i in exact_indices),
        None if exact_from is None else tuple(int(i) for i in exact_from),
    )
