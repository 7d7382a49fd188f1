"""The local guess's sweeps (Fournier et al.) on the streamed driver."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxstream.stream import kernels as K
from jaxstream.stream.readback import read_together
from jaxstream.stream.sweeps.combine import along_sweep
from jaxstream.stream.sweeps.common import kept, unit_grad
from jaxstream.stream.units import Unit, of_key


def run_local_guess(ex: Any, batch: dict, layers: list, sink: Callable, t0: float) -> float:
    """A sweep of each unit's exact local-loss gradient U_u (kept in the store's scratch), a
    sweep along U giving d = ∇L·U, and an update sweep ĝ_u = d / ‖U‖² · U_u; own local heads
    get their exact gradients as they are. ``ex``: the driver. Returns the loss."""
    x = ex._cast_batch(batch)
    hosts: dict = {}
    ends: dict = {}  # the embed's and the head's host params, for the sweep along U
    heads: dict = {}  # own local heads' exact gradients per address
    sq: list = []
    scratch: list = []
    own = ex.stack.local_head is not None
    head_dev = ex._to_device(ex.pending.apply("head", ex.store.read("head").result()))

    def keep(addr, g, host):
        if own and "local_head" in g:  # the direction reaches the module only
            heads[addr] = g["local_head"]
            g = {**g, "local_head": K.zeros32(g["local_head"])}
        if addr in ("embed", "head"):
            ends[addr] = host
        sq.append(K.sq_norm(g))
        scratch.append(ex.queue.write_scratch(addr, g))

    def done(finished):
        for u, g in finished:
            ex._each(u, g, hosts.pop(u), keep)

    (out,) = _exact_sweep(ex, x, layers, t0, head_dev, functools.partial(kept, hosts), done)
    loss, sq_sum = read_together((K.mean_loss(ex.stack, out, x), K.total(sq)))
    for task in scratch:
        for f in task.result():
            f.result()
    d = float(np.mean(along_sweep(ex, batch, layers, ends, t0, 1.0)))
    c = np.float32(d / max(float(sq_sum), float(np.finfo(np.float32).tiny)))

    def load(u: Unit):
        p = ex._like(u.key, ends, staged=True)
        g = jax.tree.map(lambda a: np.asarray(a) * c, ex.store.read_scratch(u.key).result())
        if u.key in heads:
            g = {**g, "local_head": heads[u.key]}
        return p, g

    units = [of_key(a) for a in ["embed", *layers, "head"]]
    for u, (p, g) in ex._sweep(units, load, t0, "update"):
        sink(u.key, g, p)
    return float(loss)


def _exact_sweep(ex: Any, x: dict, layers: list, t0: float, head_dev: Any, keep: Callable,
                 done: Callable) -> tuple:
    """The forward sweep of each unit's exact local-loss gradient; returns the head's
    output state."""
    z = np.int32(0)
    return ex._drive(
        layers, ex._load_both, t0, "forward",
        keep(lambda u, dev, st: unit_grad(u, K.unit_local_exact(
            ex.stack, u.part, dev, z, st[0], head_dev, x))),
        keep(lambda u, dev, st: ex.placement.local_exact(dev, u, st, head_dev, x)),
        done, state=(x["x"],))
