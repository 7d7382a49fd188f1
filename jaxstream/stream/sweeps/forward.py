"""The forward sweep with weight tangents, and the forward estimator's update, on the
streamed driver."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.grad.estimators import coefficients
from jaxstream.stream import kernels as K
from jaxstream.stream import lazy
from jaxstream.stream.readback import read_together
from jaxstream.stream.units import EMBED, LayerKey, Unit, of_key
from jaxstream.stream.values import on_host


def forward_sweep(ex: Any, batch: dict, keys: Any, layers: list, t0: float,
                  stash_idx: Any = None, also: Any = None) -> tuple:
    """The forward sweep with tangents: ``(losses, d, hosts, stash, x, also)``, the per
    micro-batch losses and derivatives read with ``also`` in one transfer; with
    ``stash_idx`` the selected micro-batches' block inputs are stashed (a hybrid's reverse
    sweep) and the last block unit kept resident."""
    x = ex._cast_batch(batch)
    stash, hosts = {}, {}
    load = ex._keeping_last(layers) if stash_idx is not None else ex._load

    def end(u, loaded, state):
        hosts[u.key], dev = loaded
        if u == EMBED:
            return K.embed_jvp(ex.stack, ex.spec, dev, x["x"], keys), []
        h, dh = state
        if stash_idx is not None:
            stash["head"] = ex.placement.keep(K.take(h, stash_idx))
        return K.head_jvp(ex.stack, ex.spec, dev, h, dh, x, keys), []

    losses, d = ex._drive(layers, load, t0, "forward", end, lambda u, loaded, st: (
        ex.placement.jvp(loaded[1], u, keys, st, stash, stash_idx), []))
    losses, d, also = read_together((losses, d, also))
    return losses, d.astype(np.float32), hosts, stash, x, also


def run_forward(ex: Any, batch: dict, key: Any, layers: list, sink: Callable, t0: float,
                commit_lazy: bool) -> tuple[float, dict]:
    """The forward estimator: the forward sweep, the K coefficients, then an update sweep
    (eager) or one (key, coefficients) record per unit, embed and head too (lazy), so a
    commit's records are the whole of its step's update. ``(loss, new records)``."""
    n = jax.tree.leaves(batch)[0].shape[0]
    keys = jnp.stack([key] * n)
    every: list[LayerKey] = ["embed", *layers, "head"]
    lazy_units = every if (ex.cfg.update == "lazy" and commit_lazy) else []
    losses, d, hosts, _, _, key_data = forward_sweep(
        ex, batch, keys, layers, t0, also=jax.random.key_data(key) if lazy_units else None)
    coeffs = _coefficients(ex, key, d.mean(axis=0), every, hosts)
    eager_units = [of_key(u) for u in every if u not in lazy_units]

    def load(u: Unit):
        p = ex._like(u.key, hosts, staged=True)
        with on_host(ex.host):
            g = K.unit_estimate(ex.spec, K.step_seg_keys(key, u.key), coeffs, p)
        return p, g

    for u, (p, g) in ex._sweep(eager_units, load, t0, "update"):
        sink(u.key, g, p)
    new = lazy.add({}, lazy_units, key, coeffs, key_data) if lazy_units else {}
    return float(np.mean(losses)), new


def _coefficients(ex: Any, key: Any, dk: np.ndarray, every: list, hosts: dict) -> np.ndarray:
    """The tangents' coefficients (1, K) from ``dk`` (K,), the derivative of the mean loss
    over all micro-batches (on the host)."""
    with on_host(ex.host):
        coeffs = coefficients(ex.spec, ex.plan.combine, jnp.asarray(dk), lambda: sum(
            K.unit_gram(ex.spec, K.unit_key(key, u), ex._like(u, hosts)) for u in every))
    return np.asarray(coeffs, np.float32)[None]
