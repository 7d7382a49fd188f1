"""Device and host functions of the streamed step, one model unit (embed/layer/head) at a time.

The forward kernels are the core's segment kernels (:mod:`jaxstream.grad.segments`) mapped
over the micro-batches, so a streamed step produces the same estimate as the in-memory estimator
for the same key.
Activations are laid out ``(N, B, ...)`` (N micro-batches) and tangents ``(N, K, B, ...)``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstream.grad import combine as cb
from jaxstream.grad import corrections as cr
from jaxstream.grad import segments as sg
from jaxstream.grad.tangents import TangentSpec, combine, gram, micro_key
from jaxstream.models.stack import Stack


def unit_key(key: jax.Array, unit: Any) -> jax.Array:
    """Tangent key of a unit ("embed", "head" or a global layer index) for a step key."""
    return sg.segment_key(key, unit)


# ----------------------------------------------------------------------------- forward (jvp)
@functools.partial(jax.jit, static_argnums=(0, 1))
def embed_jvp(stack: Stack, spec: TangentSpec, p: Any, x: jax.Array, keys: jax.Array):
    """Per micro-batch n (keys (N,)): ``(h (N,B,..), dh (N,K,B,..))`` of the embed."""
    return jax.vmap(lambda xn, kn: sg.embed_jvp(stack, spec, p, xn, kn))(x, keys)


@functools.partial(jax.jit, static_argnums=(0, 1))
def block_jvp(stack: Stack, spec: TangentSpec, p: Any, layer: jax.Array, keys: jax.Array,
              h: jax.Array, dh: jax.Array):
    """One block applied to all micro-batches, primal and K tangents."""
    return jax.vmap(lambda hn, dhn, kn: sg.block_jvp(stack, spec, p, layer, hn, dhn, kn))(
        h, dh, keys)


@functools.partial(jax.jit, static_argnums=(0, 1))
def head_jvp(stack: Stack, spec: TangentSpec, p: Any, h: jax.Array, dh: jax.Array,
             batch: dict, keys: jax.Array):
    """Per micro-batch mean loss (N,) and directional derivatives d (N, K) of it."""
    return jax.vmap(lambda hn, dhn, bn, kn: sg.head_jvp(stack, spec, p, hn, dhn, kn, bn))(
        h, dh, batch, keys)


# ----------------------------------------------------------------------------- reverse (vjp)
@functools.partial(jax.jit, static_argnums=(0,))
def embed_apply(stack: Stack, p: Any, x: jax.Array) -> jax.Array:
    return jax.vmap(lambda xn: stack.embed(p, xn))(x)


@functools.partial(jax.jit, static_argnums=(0,))
def block_apply(stack: Stack, p: Any, h: jax.Array) -> jax.Array:
    return jax.vmap(lambda hn: stack.block(p, hn))(h)


@functools.partial(jax.jit, static_argnums=(0,))
def head_loss_vjp(stack: Stack, p: Any, h: jax.Array, batch: dict, weights: jax.Array):
    """Loss of each micro-batch (N,), and the gradient of Σ_n weights[n]·loss_n w.r.t. the
    head params and the head input."""

    def total(pp, hh):
        losses = jax.vmap(lambda hn, bn: jnp.mean(stack.example_loss(
            stack.head(pp, hn).astype(jnp.float32), bn)))(hh, batch)
        return jnp.sum(weights * losses), losses

    (_, losses), (gp, gh) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(p, h)
    return losses, gp, gh


@functools.partial(jax.jit, static_argnums=(0,))
def block_vjp(stack: Stack, p: Any, h: jax.Array, ct: jax.Array):
    """Parameter gradient (summed over micro-batches) and input cotangent of one block."""
    out, pull = jax.vjp(lambda pp, hh: jax.vmap(lambda hn: stack.block(pp, hn))(hh), p, h)
    gp, gh = pull(ct.astype(out.dtype))
    return gp, gh


# ----------------------------------------------------------------------------- grouped units
@functools.partial(jax.jit, static_argnums=(0, 1))
def blocks_unit_jvp(stack: Stack, spec: TangentSpec, p: Any, first: jax.Array, keys: jax.Array,
                    h: jax.Array, dh: jax.Array):
    """:func:`block_jvp` of G consecutive blocks (params stacked on a leading axis, the first
    block's global index ``first``), one scan in one program."""
    return jax.vmap(lambda hn, dhn, kn: sg.blocks_jvp(stack, spec, p, first, hn, dhn, kn))(
        h, dh, keys)


def _blocks(stack: Stack, p: Any, h: jax.Array) -> jax.Array:
    """G stacked blocks applied in turn to every micro-batch."""
    return jax.lax.scan(lambda hh, pl: (jax.vmap(lambda hn: stack.block(pl, hn))(hh), None),
                        h, p)[0]


@functools.partial(jax.jit, static_argnums=(0,))
def blocks_unit_apply(stack: Stack, p: Any, h: jax.Array) -> jax.Array:
    """:func:`block_apply` of G stacked blocks, one scan in one program."""
    return _blocks(stack, p, h)


@functools.partial(jax.jit, static_argnums=(0,))
def blocks_unit_vjp(stack: Stack, p: Any, h: jax.Array, ct: jax.Array):
    """:func:`block_vjp` of G stacked blocks from the unit's input (each block's input
    recomputed within the program): stacked parameter gradients and the input cotangent."""
    out, pull = jax.vjp(lambda pp, hh: _blocks(stack, pp, hh), p, h)
    return pull(ct.astype(out.dtype))


@functools.partial(jax.jit, static_argnums=(0,))
def embed_vjp(stack: Stack, p: Any, x: jax.Array, ct: jax.Array):
    out, pull = jax.vjp(lambda pp: jax.vmap(lambda xn: stack.embed(pp, xn))(x), p)
    return pull(ct.astype(out.dtype))[0]


# ----------------------------------------------------------------------------- host side
@functools.partial(jax.jit, static_argnums=(0,))
def unit_estimate(spec: TangentSpec, seg_keys: jax.Array, coeffs: jax.Array, like: Any) -> Any:
    """Σ_n Σ_k coeffs[n, k] v_nk of one unit, the tangents regenerated from ``seg_keys`` (N,)."""
    return combine(spec, seg_keys, coeffs, like)


@functools.partial(jax.jit, static_argnums=(0,))
def unit_gram(spec: TangentSpec, seg_key: jax.Array, like: Any) -> jax.Array:
    """VᵀV of one unit's K tangents."""
    return gram(spec, seg_key, like)


@functools.partial(jax.jit, static_argnums=(0,))
def optax_step(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any):
    """One fp32 optax update of one unit (the optimizer must act element-wise per leaf); the
    gradient's floating leaves are cast to fp32 here, in the same program."""
    updates, opt_state = optimizer.update(to_f32(grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state


@functools.partial(jax.jit, static_argnums=(1,))
def _end_keys(keys: jax.Array, name: str) -> jax.Array:
    return jax.vmap(lambda k: unit_key(k, name))(keys)


@jax.jit
def _block_keys(keys: jax.Array, layer: jax.Array) -> jax.Array:
    return jax.vmap(lambda k: unit_key(k, layer))(keys)


def seg_keys(keys: jax.Array, unit: Any) -> jax.Array:
    """Segment keys (N,) of a unit for micro-batch keys (N,): jitted, the layer index traced
    (one compilation serves every layer; a steady step traces nothing)."""
    if isinstance(unit, str):
        return _end_keys(keys, unit)
    return _block_keys(keys, np.int32(unit))


@jax.jit
def _one(key: jax.Array) -> jax.Array:
    return key[None]


def step_seg_keys(key: jax.Array, unit: Any) -> jax.Array:
    """Segment keys (1,) of a unit for one step key (a forward estimate's update)."""
    return seg_keys(_one(key), unit)


@functools.partial(jax.jit, static_argnums=(1,))
def micro_keys(key: jax.Array, n: int) -> jax.Array:
    """The N micro-batches' keys of a step key (as the in-memory estimators draw them)."""
    return jax.vmap(lambda i: micro_key(key, i))(jnp.arange(n))


@functools.partial(jax.jit, static_argnums=(0,))
def mean_loss(stack: Stack, out: jax.Array, batch: dict) -> jax.Array:
    """The mean example loss of the head's outputs ``out`` (N, B, ...) over every sample."""
    return jnp.mean(jax.vmap(lambda o, b: stack.example_loss(o.astype(jnp.float32), b))(
        out, batch))


@jax.jit
def take(a: jax.Array, idx: jax.Array) -> jax.Array:
    """``a[idx]`` (the selected micro-batches), one dispatch."""
    return a[idx]


def total(trees: list) -> Any:
    """The leaf-wise sum of a list of pytrees (one call per sweep, on the device). Values on
    different devices (a mesh's per-stage slices beside replicated ones) are first put on one
    device, asynchronously."""
    arrays = [a for a in jax.tree.leaves(trees) if isinstance(a, jax.Array)]
    if len({frozenset(a.devices()) for a in arrays}) > 1 and all(
            a.is_fully_addressable for a in arrays):
        trees = jax.device_put(trees, min(arrays[0].devices(), key=lambda d: d.id))
    return _total(trees)


@jax.jit
def _total(trees: list) -> Any:
    return jax.tree.map(lambda *a: functools.reduce(jnp.add, a), *trees)


@jax.jit
def sq_norm(tree: Any) -> jax.Array:
    """‖tree‖² in fp32 (a device scalar: the host reads the sweep's sum once)."""
    return sum(jnp.vdot(a.astype(jnp.float32), a.astype(jnp.float32))
               for a in jax.tree.leaves(tree))


@jax.jit
def zeros32(tree: Any) -> Any:
    """fp32 zeros shaped like ``tree``."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


@jax.jit
def to_f32(tree: Any) -> Any:
    """A pytree's floating leaves as fp32 (the optimizer's precision), on their device."""
    return jax.tree.map(lambda a: a.astype(jnp.float32)
                        if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def shapes(tree: Any) -> tuple:
    """A static, hashable description of a pytree's leaves as fp32 (a combine's ``like``)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(jax.ShapeDtypeStruct(np.shape(a), jnp.float32) for a in leaves)


def _like(spec_: tuple) -> Any:
    treedef, sds = spec_
    return jax.tree.unflatten(treedef, [jnp.zeros(s.shape, s.dtype) for s in sds])


# ----------------------------------------------------------------------------- per micro-batch
@functools.partial(jax.jit, static_argnums=(0,))
def head_vjp_each(stack: Stack, p: Any, h: jax.Array, batch: dict):
    """Per selected micro-batch s: loss_s, ∂loss_s/∂head params (S, ...), ∂loss_s/∂h_s."""

    def one(hn, bn):
        f = lambda pp, hh: jnp.mean(stack.example_loss(stack.head(pp, hh).astype(jnp.float32), bn))
        loss, (gp, gh) = jax.value_and_grad(f, argnums=(0, 1))(p, hn)
        return loss, gp, gh

    return jax.vmap(one)(h, batch)


@functools.partial(jax.jit, static_argnums=(0,))
def block_vjp_each(stack: Stack, p: Any, h: jax.Array, ct: jax.Array):
    """Per micro-batch parameter gradients (S, ...) and input cotangents of one block."""

    def one(hn, cn):
        out, pull = jax.vjp(stack.block, p, hn)
        return pull(cn.astype(out.dtype))

    return jax.vmap(one)(h, ct)


@functools.partial(jax.jit, static_argnums=(0,))
def embed_vjp_each(stack: Stack, p: Any, x: jax.Array, ct: jax.Array):
    """Per micro-batch parameter gradients of the embed."""

    def one(xn, cn):
        out, pull = jax.vjp(lambda pp: stack.embed(pp, xn), p)
        return pull(cn.astype(out.dtype))[0]

    return jax.vmap(one)(x, ct)


# ----------------------------------------------------------------------------- activity perturbation
# Micro-batches on the leading axis; the weight estimates are summed over them.
@functools.partial(jax.jit, static_argnums=(0, 1))
def embed_act(stack: Stack, spec: TangentSpec, p: Any, x: jax.Array, keys: jax.Array):
    return jax.vmap(lambda xn, kn: sg.embed_act(stack, spec, p, xn, kn))(x, keys)


@functools.partial(jax.jit, static_argnums=(0, 1))
def block_act(stack: Stack, spec: TangentSpec, p: Any, layer: jax.Array, keys: jax.Array,
              h: jax.Array, dh: jax.Array):
    return jax.vmap(lambda hn, dhn, kn: sg.block_act(stack, spec, p, layer, hn, dhn, kn))(
        h, dh, keys)


@functools.partial(jax.jit, static_argnums=(0, 1))
def head_act(stack: Stack, spec: TangentSpec, p: Any, h: jax.Array, dh: jax.Array,
             batch: dict, keys: jax.Array):
    """Per-example losses (N, B) and scalars d (N, K, B)."""
    return jax.vmap(lambda hn, dhn, bn, kn: sg.head_act(stack, spec, p, hn, dhn, kn, bn))(
        h, dh, batch, keys)


def _sum0(tree):
    return jax.tree.map(lambda a: a.sum(0), tree)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def unit_act_grad(stack: Stack, spec: TangentSpec, unit: str, p: Any, layer: jax.Array,
                  keys: jax.Array, inp: jax.Array, d: jax.Array):
    """``(out, weight estimate)`` of a unit ("embed" | "block" | "head") recomputed on ``inp``
    (x for the embed, the unit's input otherwise) from the scalars ``d`` (N, K, B)."""
    fn = {"embed": stack.embed, "block": stack.block, "head": stack.head}[unit]
    seg = layer if unit == "block" else unit
    nb = d.shape[0] * d.shape[2]
    out, g = jax.vmap(lambda i, kn, dn: sg.act_grad(lambda pp: fn(pp, i), p, spec, kn, seg, dn,
                                                   nb))(inp, keys, d)
    return out, _sum0(g)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 9))
def unit_local_grad(stack: Stack, spec: TangentSpec, unit: str, p: Any, layer: jax.Array,
                    keys: jax.Array, inp: jax.Array, head: Any, batch: dict,
                    weights: bool = False):
    """``(out, weight estimate)`` of a unit under its local loss (the head applied to its
    output, the head held fixed; the head's own loss for the head): activity perturbation, or
    with ``weights`` its weights perturbed (LG-FG-W)."""
    fn = {"embed": stack.embed, "block": stack.block, "head": stack.head}[unit]
    seg = layer if unit == "block" else unit
    n = inp.shape[0]

    def one(i, kn, bn):
        example = lambda lg: stack.example_loss(lg.astype(jnp.float32), bn)
        out, g = sg.local_grad(stack, lambda pp: fn(pp, i), p, spec, kn, seg, head, example,
                               weights)
        return out, jax.tree.map(lambda a: a / n, g)

    out, g = jax.vmap(one)(inp, keys, batch)
    return out, _sum0(g)


@functools.partial(jax.jit, static_argnums=(0, 1))
def unit_local_exact(stack: Stack, unit: str, p: Any, layer: jax.Array, inp: jax.Array,
                     head: Any, batch: dict):
    """``(out, exact gradient of the unit's local loss)`` over the micro-batches (their
    mean): the local guess's direction of one unit (:func:`jaxstream.grad.local_targets`)."""
    from jaxstream.grad.local_guess import _guess_kernel

    fn = {"embed": stack.embed, "block": stack.block, "head": stack.head}[unit]
    seg = layer if unit == "block" else unit
    n = inp.shape[0]

    def one(i, bn):
        example = lambda lg: stack.example_loss(lg.astype(jnp.float32), bn)
        out, g = _guess_kernel(stack, head, example)(lambda pp: fn(pp, i), p, seg)
        return out, jax.tree.map(lambda a: a / n, g)

    out, g = jax.vmap(one)(inp, batch)
    return out, _sum0(g)


# ----------------------------------------------------------------------------- combine per unit
# One unit is one segment of the core's combine (``{"tree": ...}``); ``member`` (S,) says which
# selected micro-batches have this unit's exact gradient (nested per-layer groups).
def unit_stats(spec: TangentSpec, seg_keys: jax.Array, d: jax.Array, like: Any, *, h: Any,
               member: jax.Array, idx: jax.Array, outside: jax.Array,
               total_size: jax.Array, direction: Any = None) -> cb.Stats:
    """The combine's statistics of one unit (one segment)."""
    return cb.Stats(spec, seg_keys, d, like, h=h, counts={"tree": member.sum()},
                    outside=outside, total_size=total_size,
                    rows=cr.outside_rows({"tree": member}, idx, d.shape[0]), direction=direction)


@functools.partial(jax.jit, static_argnums=(0, 1))
def unit_combine(rule: cb.Rule, spec: TangentSpec, seg_keys: jax.Array, d: jax.Array,
                 like: Any, stats: dict, totals: dict) -> Any:
    """This unit's estimate under ``rule`` once the cross-unit ``totals`` are known."""
    return rule.estimate(unit_stats(spec, seg_keys, d, like, **stats), totals)


# ----------------------------------------------------------------------------- along a direction
@functools.partial(jax.jit, static_argnums=(0,))
def embed_along(stack: Stack, p: Any, v: Any, x: jax.Array):
    return jax.vmap(lambda xn: sg.embed_jvp_along(stack, p, v, xn))(x)


@functools.partial(jax.jit, static_argnums=(0,))
def block_along(stack: Stack, p: Any, v: Any, h: jax.Array, dh: jax.Array):
    return jax.vmap(lambda hn, dhn: sg.block_jvp_along(stack, p, v, hn, dhn))(h, dh)


@functools.partial(jax.jit, static_argnums=(0,))
def head_along(stack: Stack, p: Any, v: Any, h: jax.Array, dh: jax.Array, batch: dict):
    """Per micro-batch mean loss (N,) and its derivative along the direction (N,)."""
    return jax.vmap(lambda hn, dhn, bn: sg.head_jvp_along(stack, p, v, hn, dhn, bn))(h, dh, batch)


# ----------------------------------------------------------------------------- a hybrid's unit, on the device
@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def unit_share(rule: cb.Rule, spec: TangentSpec, like: tuple, later: bool, g_each: Any,
               member: jax.Array, seg_keys: jax.Array, d: jax.Array, common: dict) -> tuple:
    """One unit of a hybrid's reverse sweep, on the device where its exact gradients are:
    ``(estimate, h, partials, ‖h‖²)`` — the estimate under ``rule`` when the rule needs no
    other unit's share (else None), the group mean h, this unit's share of the rule's
    cross-unit sums, ‖h‖². ``like`` is :func:`shapes` of the unit's params (only the shapes
    enter the rule)."""
    params = _like(like)
    h = cb.group_stats(to_f32(g_each), {"tree": member}, params)[0]
    stats = unit_stats(spec, seg_keys, d, params, h=h, member=member, **common)
    if not later:
        return rule.estimate(stats, {}), h, {}, jnp.float32(0)
    return None, h, rule.partials(stats) if rule.cross else {}, sq_norm(h)
