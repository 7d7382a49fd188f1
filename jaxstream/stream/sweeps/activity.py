"""Activity perturbation's sweeps, and local losses' one sweep, on the streamed driver."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxstream.stream import kernels as K
from jaxstream.stream.sweeps.common import kept, unit_grad
from jaxstream.stream.units import EMBED


def run_activity(ex: Any, batch: dict, key: Any, layers: list, sink: Callable,
                 t0: float) -> float:
    """A forward sweep with tangents on every unit's output gives the per-example scalars d;
    an update sweep recomputes each unit's output and forms its weight estimate by a vjp
    through that unit alone. With local losses each unit's estimate needs only its own output
    and the head: one sweep. ``ex``: the driver. Returns the loss."""
    x = ex._cast_batch(batch)
    hosts: dict = {}
    keep = functools.partial(kept, hosts)

    def done(finished):
        for u, g in finished:
            ex._each(u, g, hosts.pop(u), sink)

    if ex.plan.forward_pass.local_losses:
        return _local(ex, x, key[None], layers, t0, keep, done)
    return _global(ex, x, key[None], layers, t0, keep, done)


def _local(ex: Any, x: dict, keys: Any, layers: list, t0: float, keep: Callable,
           done: Callable) -> float:
    """Local losses: each unit's estimate from its own output and the head, in one sweep."""
    z = np.int32(0)
    weights = ex.plan.forward_pass.tangents == "weights"
    head_dev = ex._to_device(ex.pending.apply("head", ex.store.read("head").result()))
    (out,) = ex._drive(
        layers, ex._load_both, t0, "forward",
        keep(lambda u, dev, st: unit_grad(u, K.unit_local_grad(
            ex.stack, ex.spec, u.part, dev, z, keys, st[0], head_dev, x, weights))),
        keep(lambda u, dev, st: ex.placement.local_grad(dev, u, keys, st, head_dev, x,
                                                        weights)),
        done, state=(x["x"],))
    return float(K.mean_loss(ex.stack, out, x))


def _global(ex: Any, x: dict, keys: Any, layers: list, t0: float, keep: Callable,
            done: Callable) -> float:
    """The forward sweep giving d, then the update sweep of each unit's vjp."""
    z = np.int32(0)

    def end(u, loaded, state):
        dev = loaded[1]
        if u == EMBED:
            return K.embed_act(ex.stack, ex.spec, dev, x["x"], keys), []
        return K.head_act(ex.stack, ex.spec, dev, *state, x, keys), []

    ex_loss, d = ex._drive(layers, ex._load, t0, "forward", end, lambda u, loaded, st: (
        ex.placement.act(loaded[1], u, keys, st), []))
    ex._drive(
        layers, ex._load_both, t0, "update",
        keep(lambda u, dev, st: unit_grad(u, K.unit_act_grad(
            ex.stack, ex.spec, u.part, dev, z, keys, st[0], d))),
        keep(lambda u, dev, st: ex.placement.act_grad(dev, u, keys, st, d)),
        done, state=(x["x"],))
    return float(jnp.mean(ex_loss))
