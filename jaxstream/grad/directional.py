"""Forward passes that carry tangents: directional derivatives d_k = ∇L·v_k, and the
activity-perturbation estimate. Both compose the segment kernels of :mod:`.segments`.

For a :class:`~jaxstream.models.Stack` the pass scans over the stacked blocks and draws each
block's tangent from its key inside the scan body, so only one layer's tangent is ever live
(memory of inference, constant in depth). For any other ``loss_fn`` the tangent pytree is
materialised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad import segments as sg
from jaxstream.grad.tangents import TangentSpec, tangents
from jaxstream.models.stack import Stack, loss_dtype

ACTIVITY = sg.ACTIVITY


def stack_directional(
    stack: Stack, spec: TangentSpec, params: dict, batch: dict, key: jax.Array,
    probe: Any = None,
) -> tuple[jax.Array, ...]:
    """Loss and the K directional derivatives along weight tangents of ``params``.

    Returns:
      ``(loss, d)`` with ``d`` of shape (K,); with ``probe`` (a tree shaped like ``params``)
      ``(loss, d, c)`` with c_k = probe·v_k, summed over the segments as their tangents are
      drawn (a hybrid's control-variate scalars, without drawing the tangents again).
    """
    if probe is None:
        h, dh = sg.embed_jvp(stack, spec, params["embed"], batch["x"], key)
        h, dh = sg.blocks_jvp(stack, spec, params["blocks"], 0, h, dh, key)
        return sg.head_jvp(stack, spec, params["head"], h, dh, key, batch)
    h, dh, c = sg.embed_jvp(stack, spec, params["embed"], batch["x"], key, probe["embed"])

    def body(carry, xs):
        p, pr, layer = xs
        h, dh, cl = sg.block_jvp(stack, spec, p, layer, *carry, key, pr)
        return (h, dh), cl

    layers = jnp.arange(jax.tree.leaves(params["blocks"])[0].shape[0])
    (h, dh), c_blocks = jax.lax.scan(body, (h, dh), (params["blocks"], probe["blocks"], layers))
    loss, d, c_head = sg.head_jvp(stack, spec, params["head"], h, dh, key, batch, probe["head"])
    # summed as :func:`~jaxstream.grad.tangents.project` sums them (the same rounding)
    return loss, d, c + c_blocks.sum(axis=0) + c_head


def generic_directional(
    loss_fn: Callable, spec: TangentSpec, params: Any, batch: Any, key: jax.Array,
    probe: Any = None,
) -> tuple[jax.Array, ...]:
    """Loss and directional derivatives for any ``loss_fn`` (tangents materialised); with
    ``probe`` also c_k = probe·v_k."""
    v = tangents(spec, key, params)
    out = sg.jvp_k(lambda p: loss_fn(p, batch), (params,), (v,))
    return out if probe is None else (*out, sg.probe_dot(v, probe))


def directional(
    loss_fn: Callable, spec: TangentSpec, params: Any, batch: Any, key: jax.Array,
    probe: Any = None,
) -> tuple[jax.Array, ...]:
    """Dispatch: layered pass for a :class:`Stack`, generic pass otherwise."""
    if isinstance(loss_fn, Stack):
        return stack_directional(loss_fn, spec, params, batch, key, probe)
    return generic_directional(loss_fn, spec, params, batch, key, probe)


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
    if local:
        return _activity_local(stack, spec, params, batch, key)
    # Pass 1: inject tangents at every module output; collect per-example scalars.
    h, dh = sg.embed_act(stack, spec, params["embed"], x, key)
    h, dh = sg.blocks_act(stack, spec, params["blocks"], 0, h, dh, key)
    ex_loss, d = sg.head_act(stack, spec, params["head"], h, dh, key, batch)  # d: (K, B)
    b = d.shape[1]

    # Pass 2: recompute the forward and form each module's weight estimate locally.
    _, grads = sg.segment_sweep(stack, params, x, lambda fn, p, seg: sg.act_grad(
        fn, p, spec, key, seg, d, b))
    return jnp.mean(ex_loss), grads


def _activity_local(stack, spec, params, batch, key):
    """One pass: each module output's tangent reaches only that output's local loss (the
    head's: the global loss)."""
    example = lambda lg: stack.example_loss(lg.astype(loss_dtype(lg.dtype)), batch)

    def kernel(fn, p, seg):
        return sg.local_grad(stack, fn, p, spec, key, seg, params["head"], example)

    logits, grads = sg.segment_sweep(stack, params, batch["x"], kernel)
    return jnp.mean(example(logits)), grads
