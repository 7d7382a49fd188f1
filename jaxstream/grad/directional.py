"""Forward passes that carry tangents: directional derivatives d_k = ∇L·v_k.

For a :class:`~jaxstream.models.Stack` the pass scans over the stacked blocks and draws each
block's tangent from its key inside the scan body, so only one layer's tangent is ever live
(memory of inference, constant in depth). For any other ``loss_fn`` the tangent pytree is
materialised.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxstream.grad.tangents import EMBED, HEAD, TangentSpec, block_key, leaf_tangents, tangents
from jaxstream.models.stack import Stack

ACTIVITY = 3  # key segment of activation tangents


def _jvp_k(fn: Callable, primal: Any, tangents_k: Any):
    """jvp of ``fn`` at ``primal`` for a batch of K tangents; the primal is computed once."""
    return jax.vmap(lambda t: jax.jvp(fn, (primal,), (t,)), out_axes=(None, 0))(tangents_k)


def stack_directional(
    stack: Stack, spec: TangentSpec, params: dict, batch: dict, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Loss and the K directional derivatives along weight tangents of ``params``.

    Returns:
      ``(loss, d)`` with ``d`` of shape (K,).
    """
    x = batch["x"]
    v_embed = leaf_tangents(spec, jax.random.fold_in(key, EMBED), params["embed"])
    h, dh = _jvp_k(lambda p: stack.embed(p, x), params["embed"], v_embed)

    def body(carry, xs):
        h, dh = carry
        p, layer = xs
        v = leaf_tangents(spec, block_key(key, layer), p)
        h2, dh2 = jax.vmap(
            lambda vk, dhk: jax.jvp(stack.block, (p, h), (vk, dhk)), out_axes=(None, 0)
        )(v, dh)
        return (h2, dh2), None

    layers = jnp.arange(stack.num_layers)
    (h, dh), _ = jax.lax.scan(body, (h, dh), (params["blocks"], layers))
    v_head = leaf_tangents(spec, jax.random.fold_in(key, HEAD), params["head"])
    logits, dlogits = jax.vmap(
        lambda vk, dhk: jax.jvp(stack.head, (params["head"], h), (vk, dhk)), out_axes=(None, 0)
    )(v_head, dh)
    loss, d = _jvp_k(lambda lg: jnp.mean(stack.example_loss(lg, batch)), logits, dlogits)
    return loss, d


def generic_directional(
    loss_fn: Callable, spec: TangentSpec, params: Any, batch: Any, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Loss and directional derivatives for any ``loss_fn`` (tangents materialised)."""
    v = tangents(spec, key, params)
    return _jvp_k(lambda p: loss_fn(p, batch), params, v)


def directional(
    loss_fn: Callable, spec: TangentSpec, params: Any, batch: Any, key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Dispatch: layered pass for a :class:`Stack`, generic pass otherwise."""
    if isinstance(loss_fn, Stack):
        return stack_directional(loss_fn, spec, params, batch, key)
    return generic_directional(loss_fn, spec, params, batch, key)


def _activity_keys(key: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, ACTIVITY)


def _cotangent(spec: TangentSpec, key: jax.Array, shape, d: jax.Array) -> jax.Array:
    """(1/(K·B)) Σ_k d[k, b] · u_k[b]: the estimate of ∂(mean loss)/∂output."""
    u = spec.sample(key, shape)
    k, b = d.shape
    return jnp.einsum("kb...,kb->b...", u, d.astype(u.dtype)) / (k * b)


def stack_activity(
    stack: Stack, spec: TangentSpec, params: dict, batch: dict, key: jax.Array, local: bool = False
) -> tuple[jax.Array, dict]:
    """Activity-perturbation forward gradient of a stack.

    Tangents u are put on the output of the embed, of every block and of the head (per
    example). One jvp pass gives per-example scalars d[k, b] = Σ_m ∂ℓ_b/∂out_m · u_m[k, b];
    ``(1/(K·B)) Σ_k d[k, b] u_m[k, b]`` is an unbiased estimate of ∂L/∂out_m, and each module's
    weight estimate is then formed locally by a vjp through that module alone (a second pass
    that recomputes the forward, so memory stays constant in depth).

    With ``local=True`` each hidden output gets its own loss (the shared head applied to it,
    the head held fixed) and its tangent reaches only that loss: block l then follows the
    gradient of its own local loss (greedy, biased for the global loss, much less noisy).

    Returns:
      ``(loss, grads)``.
    """
    x = batch["x"]
    akey = _activity_keys(key)
    ekey, hkey = jax.random.fold_in(akey, EMBED), jax.random.fold_in(akey, HEAD)
    example = lambda lg: stack.example_loss(lg, batch)  # noqa: E731
    local_loss = lambda h: example(stack.head(params["head"], h))  # noqa: E731

    if local:
        return _activity_local(stack, spec, params, batch, akey, local_loss)

    # Pass 1: inject tangents at every module output; collect per-example scalars.
    h0 = stack.embed(params["embed"], x)
    dh = spec.sample(ekey, h0.shape)

    def fwd(carry, xs):
        h, dh = carry
        p, layer = xs
        h2, dh2 = _jvp_k(lambda hh: stack.block(p, hh), h, dh)
        return (h2, dh2 + spec.sample(block_key(akey, layer), h2.shape)), None

    layers = jnp.arange(stack.num_layers)
    (h_last, dh), _ = jax.lax.scan(fwd, (h0, dh), (params["blocks"], layers))
    logits, dlogits = _jvp_k(lambda hh: stack.head(params["head"], hh), h_last, dh)
    dlogits = dlogits + spec.sample(hkey, logits.shape)
    ex_loss, d = _jvp_k(example, logits, dlogits)  # d: (K, B)

    # Pass 2: recompute the forward and form each module's weight estimate locally.
    g_embed = jax.vjp(lambda p: stack.embed(p, x), params["embed"])[1](
        _cotangent(spec, ekey, h0.shape, d)
    )[0]

    def bwd(h, xs):
        p, layer = xs
        h2, pull = jax.vjp(lambda pp: stack.block(pp, h), p)
        return h2, pull(_cotangent(spec, block_key(akey, layer), h2.shape, d))[0]

    h_last, g_blocks = jax.lax.scan(bwd, h0, (params["blocks"], layers))
    g_head = jax.vjp(lambda p: stack.head(p, h_last), params["head"])[1](
        _cotangent(spec, hkey, logits.shape, d)
    )[0]
    return jnp.mean(ex_loss), {"embed": g_embed, "blocks": g_blocks, "head": g_head}


def _activity_local(stack, spec, params, batch, akey, local_loss):
    """One pass: each module output's tangent reaches only that output's local loss."""
    x = batch["x"]
    ekey, hkey = jax.random.fold_in(akey, EMBED), jax.random.fold_in(akey, HEAD)

    def local_grad(fn, p, out, key, loss_of_out):
        u = spec.sample(key, out.shape)
        _, d = _jvp_k(loss_of_out, out, u)
        cot = jnp.einsum("kb...,kb->b...", u, d) / (d.shape[0] * d.shape[1])
        return jax.vjp(fn, p)[1](cot)[0]

    embed_fn = lambda p: stack.embed(p, x)  # noqa: E731
    h0 = embed_fn(params["embed"])
    g_embed = local_grad(embed_fn, params["embed"], h0, ekey, local_loss)

    def body(h, xs):
        p, layer = xs
        fn = lambda pp: stack.block(pp, h)  # noqa: E731
        h2 = fn(p)
        return h2, local_grad(fn, p, h2, block_key(akey, layer), local_loss)

    layers = jnp.arange(stack.num_layers)
    h_last, g_blocks = jax.lax.scan(body, h0, (params["blocks"], layers))
    head_fn = lambda p: stack.head(p, h_last)  # noqa: E731
    logits = head_fn(params["head"])
    example = lambda lg: stack.example_loss(lg, batch)  # noqa: E731
    g_head = local_grad(head_fn, params["head"], logits, hkey, example)
    loss = jnp.mean(example(logits))
    return loss, {"embed": g_embed, "blocks": g_blocks, "head": g_head}
