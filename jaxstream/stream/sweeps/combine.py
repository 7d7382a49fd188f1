"""The sweeps after a reverse sweep whose combine rule waits for every unit's share: the
update sweep of each unit's estimate from its group mean h_u, and the forward sweep along
u = h / ‖h‖ (DESIGN §4.3). A unit's h_u is in the store's scratch space, or — deferred to the
layer's next read — in its carry space (``carried``: unit -> (slot, crcs))."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxstream.stream import deferred
from jaxstream.stream import kernels as K
from jaxstream.stream.units import EMBED, HEAD, LayerKey, Unit, block
from jaxstream.stream.values import host_value, on_host


def read_h(ex: Any, addr: LayerKey, carried: dict) -> Any:
    """A unit's group mean h_u of this step: from its carry slot where it was deferred,
    else the scratch space."""
    if addr in carried:
        return ex.store.read_carry(addr, *carried[addr]).result()
    return ex.store.read_scratch(addr).result()


def record(ex: Any, rec: dict) -> deferred.Combine:
    """A pending combine record, refused by name unless this estimator's rule wrote it."""
    c = deferred.Combine.decode(rec)
    if c.rule != ex.plan.rule.name:
        raise ValueError(f"stream: the store holds pending updates of a hybrid with combine "
                         f"rule {c.rule!r}; this estimator's rule is {ex.plan.rule.name!r}. "
                         "Apply them first (flush()) with the estimator that wrote them")
    return c


def combined(ex: Any, unit: LayerKey, params: Any, h: Any, c: deferred.Combine) -> Any:
    """``unit``'s estimate under the plan's rule from its group mean ``h`` and the step's
    :class:`~jaxstream.stream.deferred.Combine` (the eager update sweep and a deferred update
    both form it here, from the same inputs), on the host."""
    with on_host(ex.host):
        st = {**c.common(), "h": h, "member": c.member(unit)}
        if c.scale is not None:
            st["direction"] = jax.tree.map(lambda a: np.asarray(a) * np.float32(c.scale), h)
        return K.unit_combine(ex.plan.rule, ex.spec, K.seg_keys(c.keys, unit), c.d,
                              params, st, c.totals)


def combine_sweep(ex: Any, layers: list, hosts: dict, sink: Callable, t0: float,
                  c: deferred.Combine) -> None:
    """The update sweep: each unit's estimate from h_u (scratch) and the step's scalars."""

    def uload(u: Unit):
        p = ex._like(u.key, hosts, staged=True)
        return p, combined(ex, u.key, p, read_h(ex, u.key, {}), c)

    units = [EMBED, *map(block, layers), HEAD]
    for u, (p, g) in ex._sweep(units, uload, t0, "update"):
        sink(u.key, g, p)


def along_sweep(ex: Any, batch: dict, layers: list, hosts: dict, t0: float, scale: float,
                carried: dict | None = None) -> np.ndarray:
    """A forward sweep along u = h · ``scale``: each micro-batch's derivative ∇L_n·u, (N,)."""
    x = ex._cast_batch(batch)
    carried = carried or {}
    scaled = lambda addr: jax.tree.map(lambda a: np.asarray(a) * scale,
                                       read_h(ex, addr, carried))

    def gload(u: Unit):
        if not u.is_block:
            return ex._to_device(hosts[u.key]), ex._to_device(scaled(u.key))
        dev = ex.placement.put(u, ex._block_hosts(u))
        return dev, ex.placement.put(u, [scaled(l) for l in u.layers])

    def end(u, loaded, state):
        dev, v = loaded
        if u == EMBED:
            return K.embed_along(ex.stack, dev, v, x["x"]), []
        return K.head_along(ex.stack, dev, v, *state, x), []

    _, dg = ex._drive(layers, gload, t0, "guess", end, lambda u, loaded, st: (
        ex.placement.along(loaded[0], u, loaded[1], st), []))
    return np.asarray(host_value(dg), np.float32)
