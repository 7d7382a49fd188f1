"""Activity perturbation of a layered model (:func:`jaxstream.models.from_sequential`): the
user's layers as written, shapes free to change between them.

Tangents u_l (K per example) go on the output of every layer with parameters; one jvp pass
gives per-example scalars ``d[k, b]``; layer l's output cotangent is estimated by
``(1/(K·B)) Σ_k d[k, b] u_l[k, b]`` and its weight estimate is a vjp through that layer alone
(a second pass recomputes the forward). With batch statistics (BatchNorm) an example's loss
depends on the other examples, so the scalar of the mean loss ``Σ_b d[k, b] / B`` is used for
every example instead (still unbiased, noisier). Layer l's tangents use
``block_key(fold_in(key, 3), l)``, as a stack's activity tangents do.

Example:
    >>> loss, grads = layered_activity(model, TangentSpec(num=4), params, batch, key)
    >>> # the same as jaxstream.grad.forward(4, perturb="activations")(model, params, batch, key)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxstream.grad.segments import ACTIVITY, jvp_k
from jaxstream.grad.tangents import TangentSpec, block_key
from jaxstream.models.sequential import Sequential


def layered_activity(model: Sequential, spec: TangentSpec, params: tuple, batch: dict,
                     key: jax.Array) -> tuple[jax.Array, tuple]:
    """Activity-perturbation forward gradient of a layered model: ``(loss, grads)``, unbiased."""
    model.check_batch(params, batch)
    akey = jax.random.fold_in(key, ACTIVITY)
    h, dh = batch["x"], None
    for l in range(model.num_layers):
        f = lambda hh, l=l: model.layer(l, params[l], hh)[0]
        h, dh = (f(h), None) if dh is None else jvp_k(f, (h,), (dh,))
        if model.layers[l].has_params:
            u = spec.sample(block_key(akey, l), h.shape, h.dtype)
            dh = u if dh is None else dh + u
    if dh is None:
        raise ValueError("activity perturbation: the model has no parameters")
    ex_loss, d = jvp_k(lambda out: model.example_loss(out, batch), (h,), (dh,))  # d: (K, B)
    k, b = d.shape
    coef = jnp.broadcast_to(d.mean(axis=1, keepdims=True), d.shape) if model.cross_example \
        else d / b

    h, grads = batch["x"], []
    for l in range(model.num_layers):
        if not model.layers[l].has_params:
            h = model.layer(l, params[l], h)[0]
            grads.append(params[l])
            continue
        h, pull = jax.vjp(lambda p, l=l, h=h: model.layer(l, p, h)[0], params[l])
        u = spec.sample(block_key(akey, l), h.shape, h.dtype)
        cot = jnp.einsum("kb...,kb->b...", u, coef.astype(u.dtype)) / k
        grads.append(pull(cot)[0])
    return jnp.mean(ex_loss), tuple(grads)


def is_layered(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` is a layered model this module runs."""
    return isinstance(loss_fn, Sequential)
