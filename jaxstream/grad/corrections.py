"""Corrections that mix forward estimates with exact gradients of a subset of micro-batches.

The formulas the combine rules of :mod:`jaxstream.grad.combine` are made of (the choice between
them lives there only). A step has N micro-batches, each with K directional derivatives ``d[n, k] = ∇L_n·v_nk``.
A selected subset also has exact gradients. Groups are per *segment*: for a stack, the embed,
each block l and the head are segments, and segment s has its own group G_s (the micro-batches
whose exact gradient reaches it: nested G_embed = G_0 ⊆ G_1 ⊆ … ⊆ G_head, as a pipeline with
truncated backward chains produces); any other params pytree is one segment.

Everything here works on a *slice* of a stack too (``first_layer`` = global index of its first
block), so a pipeline stage applies the same code to its own layers; the only cross-segment
quantities are the scalars ``c[n, k] = Σ_s h_s·v_nk,s`` (sum ``project`` over stages) and, for
``weighted``, the scalar ``q``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad.tangents import TangentSpec, combine, project
from jaxstream.models.stack import is_stack_params, loss_dtype


def _bcast(v: jax.Array, ndim: int) -> jax.Array:
    return v.reshape(v.shape + (1,) * (ndim - v.ndim))


def scalar_dtype(like: Any) -> Any:
    """The dtype of a segment's masks, counts, sizes, β and norms: the parameters' widest
    floating dtype, at least float32. In float32 a weight such as 1/3 is rounded to float32's
    precision, which a float64 model would inherit (its all-exact hybrid 3e-8 off backprop)."""
    return loss_dtype(*(jnp.result_type(x) for x in jax.tree.leaves(like)))


def _per_leaf(seg: dict, like: Any) -> Any:
    """Spread per-segment values onto the leaves of ``like`` (same structure as ``like``)."""
    if not is_stack_params(like):
        return jax.tree.map(lambda _: seg["tree"], like)
    return {name: jax.tree.map(lambda _, v=seg[name]: v, like[name]) for name in like}


def group_masks(like: Any, depth: jax.Array) -> dict:
    """Per-segment membership of the k selected micro-batches.

    Args:
      like: params (or a slice of a stack's params).
      depth: (k,) int; selected micro-batch i has an exact gradient for blocks with global index
        ``>= depth[i]`` (0: every segment; ``L``: the head only). For non-stack params every
        selected micro-batch is in the one group.
    Returns:
      ``{"embed": (k,), "blocks": (k, L), "head": (k,)}`` float masks, or ``{"tree": (k,)}``,
      in :func:`scalar_dtype` of ``like`` (so are the counts and weights derived from them).
    """
    dtype = scalar_dtype(like)
    if not is_stack_params(like):
        return {"tree": jnp.ones(depth.shape, dtype)}
    layers = jnp.arange(jax.tree.leaves(like["blocks"])[0].shape[0])
    return group_masks_for_layers(depth, layers, dtype)


def group_masks_for_layers(depth: jax.Array, layers: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Masks for blocks with global indices ``layers``; the embed is in block 0's group and the
    head in the group of every selected micro-batch with ``depth <= L`` (always, here)."""
    m_blocks = (depth[:, None] <= layers[None, :]).astype(dtype)
    m_embed = (depth <= 0).astype(dtype)
    return {"embed": m_embed, "blocks": m_blocks, "head": jnp.ones(depth.shape, dtype)}


def group_mean(exact: Any, masks: dict, like: Any) -> tuple[Any, dict]:
    """h_s = mean of the exact gradients in each segment's group (0 where the group is empty).

    Args:
      exact: exact gradients of the k selected micro-batches (leaves with a leading k axis).
      masks: from :func:`group_masks`.
    Returns:
      ``(h, counts)``; counts per segment.
    """
    counts = {name: m.sum(axis=0) for name, m in masks.items()}
    m_leaf = _per_leaf(masks, like)
    c_leaf = _per_leaf(counts, like)
    h = jax.tree.map(
        lambda g, m, c: (_bcast(m, g.ndim) * g).sum(0) / _bcast(jnp.maximum(c, 1.0), g.ndim - 1),
        exact,
        m_leaf,
        c_leaf,
    )
    return h, counts


def segment_sizes(like: Any) -> dict:
    """Number of parameters per segment (blocks: per layer), in :func:`scalar_dtype`."""
    dtype = scalar_dtype(like)
    size = lambda t: jnp.asarray(sum(x.size for x in jax.tree.leaves(t)), dtype)
    if not is_stack_params(like):
        return {"tree": size(like)}
    num_layers = jax.tree.leaves(like["blocks"])[0].shape[0]
    per_layer = sum(x.size for x in jax.tree.leaves(like["blocks"])) // num_layers
    return {"embed": size(like["embed"]), "blocks": jnp.full((num_layers,), per_layer, dtype),
            "head": size(like["head"])}


def outside_rows(masks: dict, idx: jax.Array, n: int) -> dict:
    """Per segment, 1 for the N micro-batches outside the segment's group, 0 inside: the rows
    whose residual is still estimated by tangents (a member's residual g_n − h is known); in
    the masks' dtype."""
    dtype = loss_dtype(*(jnp.result_type(m) for m in masks.values()))
    masks = {name: jnp.asarray(m, dtype) for name, m in masks.items()}
    onehot = jax.nn.one_hot(idx, n, dtype=dtype)  # (k, N)
    return {name: 1.0 - jnp.tensordot(m, onehot, axes=((0,), (0,))) if m.ndim == 1
            else 1.0 - jnp.einsum("kl,kn->ln", m, onehot) for name, m in masks.items()}


def shrinkage(counts: dict, sizes: dict, n: int, k: int,
              total_size: float | None = None) -> dict:
    """β per segment for the ``weighted`` correction: β = a / (a + b) minimises the expected
    squared error of h + β·r, where r = (1/N) Σ_{n∉G} r̂_n is the forward residual estimate.

    * a = E‖h − ḡ‖² = S² (1/|G| − 1/N) for |G| of the N micro-batches drawn without
      replacement, S² the spread of the N micro-batch gradients (divided by N − 1);
    * b = Var r ≈ (N − |G|) P q / (N² K), with P the segment's size and q = mean (d − c)² over
      the micro-batches outside the group;
    * S² is taken from the same residual scalars, not from the selected gradients' spread:
      E q = E_{n∉G} ‖g_n − h‖² = S²_model (1 + 1/|G|), shared among segments in proportion to
      their size, S² ≈ q |G| / (|G| + 1) · P / P_total.

    So q cancels and β = a' / (a' + b') with a' = |G| / (|G| + 1) · (1/|G| − 1/N) / P_total
    and b' = (N − |G|) / (N² K): a number fixed by N, |G|, K and the model's size P_total
    (``total_size``; default the sum of ``sizes``, right unless ``sizes`` covers only a pipeline
    stage). A β estimated from the selected micro-batches moves with h − ḡ and biases the
    estimate even under a random selection; this one does not: with a random selection
    E[h + β r] = E[h + β(ḡ − h)] = ḡ. With a *fixed* selection (``exact_indices``, a pipeline's
    static table) a share (1 − β) of h's systematic deviation stays: ``weighted`` is then biased
    towards the selected micro-batches (docs/engines.md measures it). With the whole batch
    exact β = 0; with an empty group (h = 0) β = 1, the plain forward estimate.
    """
    if total_size is None:
        total_size = sum(jnp.sum(v) for v in sizes.values())
    out = {}
    for name, c in counts.items():
        c = jnp.asarray(c, loss_dtype(jnp.result_type(c), jnp.result_type(total_size)))
        cc = jnp.maximum(c, 1.0)
        a = cc / (cc + 1.0) * (1.0 / cc - 1.0 / n) / total_size
        b = (n - c) / (n * n * k)
        beta = jnp.where(a + b > 0, a / jnp.maximum(a + b, 1e-30), 0.0)
        out[name] = jnp.where(c >= 1, beta, 1.0)
    return out


def residual_variance(counts: dict, sizes: dict, q: jax.Array, n: int, k: int) -> dict:
    """b per segment: the variance of the tangent part r = (1/N) Σ_{n∉G} r̂_n, about
    (N − |G|) P q / (N² K) (see :func:`shrinkage`)."""
    return {name: sizes[name] * q * (n - c) / (n * n * k) for name, c in counts.items()}


def _segment_sq(tree: Any, like: Any) -> dict:
    """‖tree‖² per segment (blocks: per layer), in each leaf's dtype (at least float32)."""
    sq = lambda t, lead: sum(jnp.sum(jnp.square(x.astype(loss_dtype(x.dtype))).reshape(
        x.shape[:lead] + (-1,)), axis=-1) for x in jax.tree.leaves(t))
    if not is_stack_params(like):
        return {"tree": sq(tree, 0)}
    return {"embed": sq(tree["embed"], 0), "blocks": sq(tree["blocks"], 1),
            "head": sq(tree["head"], 0)}


def stein_beta(resid: Any, variance: dict, counts: dict, like: Any) -> dict:
    """Positive-part James–Stein weight per segment: β = max(0, 1 − b / ‖r‖²).

    ‖r‖² − b estimates ‖E r‖² = ‖ḡ − h‖² from the residual itself, whatever made h deviate (a
    random or a *fixed* selection), so where the exact mean is systematically off β stays near
    1 — less bias than :func:`shrinkage`'s fixed weight when that deviation stands out of the
    tangent noise. But ‖r‖² moves with h − ḡ, so with a random selection β and h − ḡ are
    correlated and ``stein`` keeps a small bias that ``weighted`` does not (docs/engines.md
    measures both). An empty group (h = 0) keeps β = 1 (the plain forward estimate).
    """
    sq = _segment_sq(resid, like)
    out = {}
    for name, b in variance.items():
        beta = jnp.where(sq[name] > 0, jnp.maximum(0.0, 1.0 - b / jnp.maximum(sq[name], 1e-30)),
                         0.0)
        out[name] = jnp.where(counts[name] >= 1, beta, 1.0)
    return out


def residual_q(d: jax.Array, c: jax.Array, outside: jax.Array) -> jax.Array:
    """q = mean (d − c)² over the micro-batches whose residual is estimated (``outside`` (N,))."""
    w = outside[:, None] * jnp.ones_like(d)
    return jnp.sum(w * (d - c) ** 2) / jnp.maximum(jnp.sum(w), 1.0)


def control_variate(spec: TangentSpec, keys, d, h, c, like, first_layer: int = 0,
                    beta: dict | None = None, rows: dict | None = None,
                    stein: tuple[dict, dict] | None = None) -> Any:
    """ĝ = h + β · (1/(N K)) Σ_{n∉G} Σ_k (d_nk − c_nk) v_nk, with c_nk = h·v_nk summed over all
    segments (β = 1: the unbiased control variate). A member n ∈ G of the segment's group needs
    no tangent: its residual g_n − h is known exactly and the members' residuals sum to zero, so
    ``rows`` (:func:`outside_rows`) drops them; with every micro-batch exact ĝ = h = backprop.
    ``stein``: ``(variance, counts)`` per segment — β from :func:`stein_beta` instead.

    A β known before the sum (``beta``, or none) scales the rows, and the sum is added into h's
    own buffer (:func:`~jaxstream.grad.tangents.combine`'s ``init``): no residual tree is
    materialised. ``stein`` needs ‖r‖², so its residual is formed first."""
    n = d.shape[0]
    # the residual scalars in fp32 (d comes in the compute dtype, c as h's sums: bf16 compute
    # would otherwise mix the two)
    coeffs = (d.astype(jnp.float32) - c.astype(jnp.float32)) / (n * spec.num)
    if stein is None:
        if beta is not None:
            rows = _scaled_rows(rows, beta, n, like)
        return combine(spec, keys, coeffs, like, first_layer, rows=rows, init=h)
    resid = combine(spec, keys, coeffs, like, first_layer, rows=rows)
    beta = stein_beta(resid, *stein, like)
    b_leaf = _per_leaf(beta, like)
    return jax.tree.map(lambda hh, r, b: hh + _bcast(b, r.ndim).astype(r.dtype) * r, h, resid,
                        b_leaf)


def _scaled_rows(rows: dict | None, beta: dict, n: int, like: Any) -> dict:
    """``rows`` (ones where None) times β per segment (blocks: per layer)."""
    dtype = scalar_dtype(like)
    if rows is None:
        ones = jnp.ones((n,), dtype)
        if not is_stack_params(like):
            rows = {"tree": ones}
        else:
            num_layers = jax.tree.leaves(like["blocks"])[0].shape[0]
            rows = {"embed": ones, "blocks": jnp.ones((num_layers, n), dtype), "head": ones}
    out = {}
    for name, r in rows.items():
        r_dtype = loss_dtype(jnp.result_type(r), dtype)
        out[name] = r.astype(r_dtype) * _bcast(jnp.asarray(beta[name], r_dtype), r.ndim)
    return out


def residual_scalars(spec: TangentSpec, keys, h, like_first_layer: int = 0) -> jax.Array:
    """c[n, k] = h·v_nk over the segments of ``h`` (sum the result over pipeline stages)."""
    return project(spec, keys, h, like_first_layer)
