"""Segment kernels: what one segment of a stack (embed, one block, head) computes for an
estimator, for one micro-batch, keyed by the one tangent schedule of :mod:`.tangents`.

Every engine composes these and nothing else: the in-memory estimators scan them over the
stacked blocks, a pipeline stage runs them on its slice, the streamed executor runs them one
layer at a time over all micro-batches (``jax.vmap``). So the engines agree by construction.

* weight perturbation: :func:`embed_jvp`, :func:`block_jvp` (:func:`blocks_jvp` scans a
  slice), :func:`head_jvp` carry K tangents ``dh`` of the activations and give the directional
  derivatives d_k = ∇L·v_k;
* activity perturbation: :func:`embed_act`, :func:`block_act`, :func:`head_act` inject a fresh
  tangent u on each segment's output and give per-example scalars d[k, b]; the weight estimate
  of a segment is then :func:`act_grad` — a vjp through that segment alone with the cotangent
  (1/(K·B)) Σ_k d[k, b] u[k, b];
* local losses: :func:`local_grad` (:func:`local_act_grad`, :func:`local_weight_grad`) — a
  segment's tangent reaches only its own loss (the shared head's, or its own local head's).

Activation tangents use ``fold_in(fold_in(key, ACTIVITY), segment)`` with the segment keyed
as weights are (embed 0, block l via ``block_key``, head 2), in the activations' dtype.

Example:
  >>> h, dh = embed_jvp(stack, spec, params["embed"], x, key)
  >>> h, dh = blocks_jvp(stack, spec, params["blocks"], 0, h, dh, key)
  >>> loss, d = head_jvp(stack, spec, params["head"], h, dh, key, batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.random import fold_in

from jaxstream.grad.tangents import EMBED, HEAD, TangentSpec, block_key, leaf_tangents
from jaxstream.grad.threefry import tied
from jaxstream.models.stack import Stack, loss_dtype

ACTIVITY = 3  # key segment of activation tangents


def jvp_k(fn: Callable, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    """jvp of ``fn`` for K tangents at once (leading axis K of every tangent); the primal is
    computed once."""
    return jax.vmap(lambda *t: jax.jvp(fn, primals, t), out_axes=(None, 0))(*tangents)


def segment_key(key: jax.Array, segment: Any) -> jax.Array:
    """Tangent key of a segment ("embed", "head" or a global layer index) of a micro-batch key."""
    if isinstance(segment, str):
        return fold_in(key, EMBED if segment == "embed" else HEAD)
    return block_key(key, segment)


def _mean_loss(stack: Stack, batch: dict) -> Callable:
    return lambda logits: jnp.mean(stack.example_loss(
        logits.astype(loss_dtype(logits.dtype)), batch))


# ----------------------------------------------------------------------- weight perturbation
def probe_dot(v: Any, probe: Any) -> jax.Array:
    """(K,) ⟨probe, v_k⟩ of a segment's K tangents (leaves (K, *shape)) and a tree shaped like
    the segment (a hybrid's h: the control variate's scalars c_k = h·v_k, formed while the
    forward pass holds the tangents instead of redrawing them)."""
    parts = [_dot(vv, pp.astype(vv.dtype)) for vv, pp in zip(jax.tree.leaves(v), jax.tree.leaves(probe))]
    return sum(parts, 0.0)


def _dot(v: jax.Array, p: jax.Array) -> jax.Array:
    """(K,) Σ v_k ⊙ p as one matrix-vector product of the flattened leaf, as
    :func:`jaxstream.grad.tangents.project` forms it (accumulated in at least float32, returned
    in ``v``'s dtype). XLA reads the tangent once, where an elementwise product and a reduction
    wrote and read back a tangent-sized buffer per micro-batch and layer (a hybrid's forward
    pass draws one tangent per micro-batch: this was a sixth of its step)."""
    acc = v.dtype if jnp.finfo(v.dtype).bits >= 32 else jnp.dtype(jnp.float32)
    out = jax.lax.dot_general(v.reshape(v.shape[0], -1), p.reshape(-1),
                              (((1,), (0,)), ((), ())), preferred_element_type=acc)
    return out.astype(v.dtype)


def _with_probe(out: tuple, v: Any, probe: Any) -> tuple:
    return out if probe is None else (*out, probe_dot(v, probe))


def embed_jvp(stack: Stack, spec: TangentSpec, p: Any, x: jax.Array, key: jax.Array,
              probe: Any = None):
    """``(h, dh)``: the embed's output and its K tangents (embed weights perturbed). An embed
    without parameters gives zero tangents. With ``probe`` (shaped like ``p``) also
    :func:`probe_dot` of the tangents."""
    if not jax.tree.leaves(p):
        h = stack.embed(p, x)
        out = (h, jnp.zeros((spec.num,) + h.shape, h.dtype))
        return out if probe is None else (*out, jnp.zeros((spec.num,), loss_dtype(h.dtype)))
    v = leaf_tangents(spec, segment_key(key, "embed"), p)
    return _with_probe(jvp_k(lambda pp: stack.embed(pp, x), (p,), (v,)), v, probe)


def block_jvp(stack: Stack, spec: TangentSpec, p: Any, layer: Any, h: jax.Array,
              dh: jax.Array, key: jax.Array, probe: Any = None):
    """``(h, dh)`` through block ``layer`` (global index), its weights perturbed (with
    ``probe``: also :func:`probe_dot` of the block's tangents)."""
    # The tangent is drawn once the block's primal output exists (XLA merges this primal with
    # the jvp's own): drawn earlier, its words would be held through the jvp's peak.
    out = stack.block(p, h)
    v = leaf_tangents(spec, block_key(tied(key, out), layer), p)
    return _with_probe(jvp_k(stack.block, (p, h), (v, dh.astype(h.dtype))), v, probe)


def blocks_jvp(stack: Stack, spec: TangentSpec, blocks: Any, first_layer: Any, h: jax.Array,
               dh: jax.Array, key: jax.Array):
    """:func:`block_jvp` scanned over stacked ``blocks`` whose first has global index
    ``first_layer``: one layer's tangent live at a time."""
    return _scan_blocks(block_jvp, stack, spec, blocks, first_layer, h, dh, key)


def _scan_blocks(kernel: Callable, stack: Stack, spec: TangentSpec, blocks: Any,
                 first_layer: Any, h: jax.Array, dh: jax.Array, key: jax.Array):
    """``kernel(stack, spec, p, layer, h, dh, key)`` scanned over the stacked blocks."""

    def body(carry, xs):
        p, layer = xs
        return kernel(stack, spec, p, layer, *carry, key), None

    n = jax.tree.leaves(blocks)[0].shape[0]
    (h, dh), _ = jax.lax.scan(body, (h, dh), (blocks, first_layer + jnp.arange(n)))
    return h, dh


def segment_sweep(stack: Stack, params: dict, x: jax.Array, kernel: Callable,
                  first_layer: Any = 0, *, embed: bool = True,
                  head: bool = True) -> tuple[jax.Array, dict]:
    """embed → blocks → head with one kernel per segment: ``kernel(fn, p, segment) -> (out,
    grad)``, where ``out = fn(p)`` is the segment's output on its input and ``segment`` is
    ``"embed"``, a block's global layer index (traced) or ``"head"``. Blocks are scanned, so one
    layer's work is live at a time. A slice of the model (a pipeline stage) leaves out the
    embed (``x`` is then the first block's input) or the head (the output is the last block's);
    a left-out segment's result is zeros. Returns the output and the per-segment results."""
    zeros = lambda name: jax.tree.map(jnp.zeros_like, params[name])
    h, g_embed = (kernel(lambda p: stack.embed(p, x), params["embed"], "embed") if embed
                  else (x, zeros("embed")))

    def body(h, xs):
        p, layer = xs
        return kernel(lambda pp: stack.block(pp, h), p, layer)

    n = jax.tree.leaves(params["blocks"])[0].shape[0]
    h, g_blocks = jax.lax.scan(body, h, (params["blocks"], first_layer + jnp.arange(n)))
    out, g_head = (kernel(lambda p: stack.head(p, h), params["head"], "head") if head
                   else (h, zeros("head")))
    return out, {"embed": g_embed, "blocks": g_blocks, "head": g_head}


def head_jvp(stack: Stack, spec: TangentSpec, p: Any, h: jax.Array, dh: jax.Array,
             key: jax.Array, batch: dict, probe: Any = None):
    """``(loss, d)``: the micro-batch's mean loss and its K directional derivatives (with
    ``probe``: also :func:`probe_dot` of the head's tangents)."""
    v = leaf_tangents(spec, segment_key(key, "head"), p)
    logits, dlogits = jvp_k(stack.head, (p, h), (v, dh.astype(h.dtype)))
    # The labels wait for h: XLA would otherwise build the loss's gather indices before the
    # scan over blocks and keep them through it.
    batch = tied(batch, h)
    return _with_probe(jvp_k(_mean_loss(stack, batch), (logits,), (dlogits,)), v, probe)


# --------------------------------------------------------------------- activity perturbation
def activity_key(key: jax.Array) -> jax.Array:
    """Root of a micro-batch's activation tangents."""
    return fold_in(key, ACTIVITY)


def _u(spec: TangentSpec, key: jax.Array, segment: Any, out: jax.Array) -> jax.Array:
    return spec.sample(segment_key(activity_key(key), segment), out.shape, out.dtype)


def embed_act(stack: Stack, spec: TangentSpec, p: Any, x: jax.Array, key: jax.Array):
    """``(h, dh)``: the embed's output and the tangents u injected on it."""
    h = stack.embed(p, x)
    return h, _u(spec, key, "embed", h)


def block_act(stack: Stack, spec: TangentSpec, p: Any, layer: Any, h: jax.Array,
              dh: jax.Array, key: jax.Array):
    """``(h, dh)``: tangents carried through block ``layer`` plus a fresh u on its output."""
    h2, dh2 = jvp_k(lambda hh: stack.block(p, hh), (h,), (dh.astype(h.dtype),))
    return h2, dh2 + _u(spec, key, layer, h2)


def blocks_act(stack: Stack, spec: TangentSpec, blocks: Any, first_layer: Any, h: jax.Array,
               dh: jax.Array, key: jax.Array):
    """:func:`block_act` scanned over stacked ``blocks``."""
    return _scan_blocks(block_act, stack, spec, blocks, first_layer, h, dh, key)


def head_act(stack: Stack, spec: TangentSpec, p: Any, h: jax.Array, dh: jax.Array,
             key: jax.Array, batch: dict):
    """``(example_losses (B,), d (K, B))``: per-example scalars Σ_m ∂ℓ_b/∂out_m · u_m[k, b]
    over every segment output m."""
    logits, dlogits = jvp_k(lambda hh: stack.head(p, hh), (h,), (dh.astype(h.dtype),))
    dlogits = dlogits + _u(spec, key, "head", logits)
    example = lambda lg: stack.example_loss(lg.astype(loss_dtype(lg.dtype)), batch)
    return jvp_k(example, (logits,), (dlogits,))


def act_cotangent(spec: TangentSpec, key: jax.Array, segment: Any, out: jax.Array,
                  d: jax.Array, num_examples: int) -> jax.Array:
    """(1/(K·B_total)) Σ_k d[k, b] · u_k[b]: the estimate of ∂(mean loss)/∂out of a segment."""
    u = _u(spec, key, segment, out)
    k = d.shape[0]
    acc = loss_dtype(u.dtype, d.dtype)
    cot = jnp.einsum("kb...,kb->b...", u.astype(acc), d.astype(acc))
    return (cot / (k * num_examples)).astype(out.dtype)


def act_grad(fn: Callable, p: Any, spec: TangentSpec, key: jax.Array, segment: Any,
             d: jax.Array, num_examples: int) -> tuple[jax.Array, Any]:
    """``(out, weight estimate)`` of a segment ``out = fn(p)`` (forward recomputed) from the
    scalars ``d`` (K, B) of :func:`head_act`. ``num_examples``: the examples the loss averages."""
    out, pull = jax.vjp(fn, p)
    return out, pull(act_cotangent(spec, key, segment, out, d, num_examples))[0]


def local_act_grad(fn: Callable, p: Any, spec: TangentSpec, key: jax.Array, segment: Any,
                   local_loss: Callable) -> tuple[jax.Array, Any]:
    """``(out, weight estimate)`` of a segment under its own loss ``local_loss(out) -> (B,)``:
    the tangent on ``out`` reaches only that loss (greedy: biased for the global loss, much less
    noisy)."""
    out, pull = jax.vjp(fn, p)
    u = _u(spec, key, segment, out)
    _, d = jvp_k(local_loss, (out,), (u,))
    return out, pull(act_cotangent(spec, key, segment, out, d, d.shape[1]))[0]


def grouped_act_grad(fn: Callable, p: Any, spec: TangentSpec, key: jax.Array, segment: Any,
                     group_losses: Callable, cells: tuple | None = None
                     ) -> tuple[jax.Array, Any]:
    """``(out, weight estimate)`` of a segment whose output splits into C cells, each with its
    own loss: ``group_losses(out) -> (C, B)``, cell c's reading only its own slice (or, as
    Ren et al.'s feature aggregator, every other cell held fixed). ``cells``: ((axis, count),
    ...) of the split axes of ``out`` in ascending order, C the product of the counts, row c of
    the losses the cells in row-major order; None: the G contiguous groups of the last axis.
    The tangent's cell c is weighted by its own loss's derivative d_c = ∇L_c·u_c only, so the
    estimate is unbiased for the gradient of the mean of the C cell losses."""
    out, pull = jax.vjp(fn, p)
    u = _u(spec, key, segment, out)  # (K, B, ...)
    _, d = jvp_k(group_losses, (out,), (u,))  # (K, C, B)
    k, c, b = d.shape
    cells = ((out.ndim - 1, c),) if cells is None else tuple(
        (axis % out.ndim, n) for axis, n in cells)
    acc = loss_dtype(u.dtype, d.dtype)
    split = dict(cells)
    shape_u, shape_w = list(u.shape[:2]), [k, b]
    for i, size in enumerate(out.shape[1:], start=1):  # u's axis i + 1
        n = split.get(i, 1)
        shape_u += [n, size // n] if i in split else [size]
        shape_w += [n, 1] if i in split else [1]
    ug = u.reshape(shape_u).astype(acc)
    w = jnp.moveaxis(d, 1, -1).astype(acc).reshape(shape_w)  # (K, B, ..., n_i, 1, ...)
    cot = jnp.sum(w * ug, axis=0).reshape(out.shape) / (k * b * c)
    return out, pull(cot.astype(out.dtype))[0]


def own_losses(stack: Stack, own: Any, h: jax.Array, example: Callable) -> jax.Array:
    """``(G, B)``: a segment's local losses under its own local heads ``own`` (one row without
    groups)."""
    logits = stack.local_head(own, h)
    return jax.vmap(example)(logits) if stack.local_groups > 1 else example(logits)[None]


def local_weight_grad(fn: Callable, p: Any, spec: TangentSpec, key: jax.Array, segment: Any,
                      local_loss: Callable) -> tuple[jax.Array, Any]:
    """``(out, weight estimate)`` of a segment under its own loss, its *weights* perturbed
    (LG-FG-W): (1/K) Σ_k d_k v_k with d_k = ∇_p mean(local_loss(fn(p)))·v_k and v_k the
    segment's weight tangents (keyed as :func:`embed_jvp` / :func:`block_jvp` key them)."""
    v = leaf_tangents(spec, segment_key(key, segment), p)
    out, dout = jvp_k(fn, (p,), (v,))
    _, d = jvp_k(lambda o: jnp.mean(local_loss(o)), (out,), (dout,))
    acc = loss_dtype(jax.tree.leaves(p)[0].dtype, d.dtype)
    d = d.astype(acc)
    return out, jax.tree.map(lambda t: (jnp.tensordot(d, t.astype(acc), axes=1)
                                        / spec.num).astype(t.dtype), v)


def local_grad(stack: Stack, fn: Callable, p: Any, spec: TangentSpec, key: jax.Array,
               segment: Any, head: Any, example: Callable, weights: bool = False):
    """``(out, estimate)`` of a segment ``out = fn(p)`` under its local loss, activity
    perturbed (:func:`local_act_grad`) or with ``weights`` weight perturbed
    (:func:`local_weight_grad`): the one rule every engine runs.

    The head's local loss is the global one (``example(logits) -> (B,)``). Another segment's is
    ``example`` of the shared head ``head`` (held fixed) applied to its output; or, on a stack
    with its own local heads (``stack.local_head``, :func:`jaxstream.models.with_local_heads`),
    of the segment's own head ``p["local_head"]``: the tangents then perturb the segment's
    module ``p["module"]`` only, and the local head follows the exact gradient of its loss
    (the segment's output held fixed), as Ren et al. (2023) train theirs.
    """
    kernel = local_weight_grad if weights else local_act_grad
    if isinstance(segment, str) and segment == "head":
        return kernel(fn, p, spec, key, segment, example)
    if stack.local_head is None:
        return kernel(fn, p, spec, key, segment, lambda h: example(stack.head(head, h)))
    own = p["local_head"]
    module = lambda m: fn({"module": m, "local_head": own})
    if stack.local_groups > 1:
        if weights:
            raise ValueError(f"local_forward_weights: {stack.name!r} has grouped local losses, "
                             "whose tangents must each reach one group's loss; a weight tangent "
                             "reaches every group of a block's output. Use activity "
                             "perturbation (forward, perturb: activations, local_losses: true)")
        out, g = grouped_act_grad(module, p["module"], spec, key, segment,
                                  lambda h: own_losses(stack, own, h, example),
                                  stack.local_cells or None)
    else:
        out, g = kernel(module, p["module"], spec, key, segment,
                        lambda h: example(stack.local_head(own, h)))
    return out, {"module": g, "local_head": own_head_grad(stack, own, out, example)}


def own_head_grad(stack: Stack, own: Any, out: jax.Array, example: Callable) -> Any:
    """The exact gradient of a segment's own local head ``own`` for its loss (the mean of its
    group losses, :func:`own_losses`), the segment's output held fixed."""
    fixed = jax.lax.stop_gradient(out)
    return jax.grad(lambda q: jnp.mean(own_losses(stack, q, fixed, example)))(own)


# ----------------------------------------------------------------------- one given direction
# The ``guess`` correction differentiates along a direction it already has (the exact mean h),
# not along drawn tangents: the same passes with the tangent given.
def embed_jvp_along(stack: Stack, p: Any, v: Any, x: jax.Array):
    """``(h, dh)`` of the embed along the weight direction ``v``."""
    return jax.jvp(lambda pp: stack.embed(pp, x), (p,), (v,))


def block_jvp_along(stack: Stack, p: Any, v: Any, h: jax.Array, dh: jax.Array):
    """``(h, dh)`` through one block along its weight direction ``v``."""
    return jax.jvp(stack.block, (p, h), (v, dh.astype(h.dtype)))


def head_jvp_along(stack: Stack, p: Any, v: Any, h: jax.Array, dh: jax.Array, batch: dict):
    """``(loss, dloss)``: the micro-batch's mean loss and its derivative along the direction."""
    logits, dlogits = jax.jvp(stack.head, (p, h), (v, dh.astype(h.dtype)))
    return jax.jvp(_mean_loss(stack, batch), (logits,), (dlogits,))
