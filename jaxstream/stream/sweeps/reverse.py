"""The reverse sweep on the streamed driver: exact gradients of every micro-batch (backprop,
exact subsets) or of the selected ones (a hybrid), each unit's estimate formed by the plan's
combine rule in the sweep, or — a rule that needs every unit's share, or a direction — in the
sweeps of :mod:`jaxstream.stream.sweeps.combine` after it; with ``update="lazy"`` that update
is deferred to each unit's next read (pending records; h_u in the store's carry space)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.stream import deferred
from jaxstream.stream import kernels as K
from jaxstream.stream.readback import read_together
from jaxstream.stream.sweeps.combine import along_sweep, combine_sweep
from jaxstream.stream.sweeps.forward import forward_sweep
from jaxstream.stream.units import EMBED, HEAD, Unit
from jaxstream.stream.values import host_value


def run_reverse(ex: Any, batch: dict, key: Any, layers: list, sink: Callable, t0: float,
                commit_lazy: bool = False) -> tuple[float, dict]:
    """The forward sweep (stashing the block inputs of the exact micro-batches), the reverse
    sweep, and the combine rule's sweeps after it: ``(loss, new pending records)``."""
    n = jax.tree.leaves(batch)[0].shape[0]
    if not ex.plan.mixes:
        _, hosts, stash, x = plain_sweep(ex, batch, layers, t0)
        losses = reverse_sweep(ex, layers, hosts, stash, x, False, sink, t0)
        return float(np.mean(losses)), {}
    # the selection, its depths and the key's data: one transfer
    idx, depth, key_data = read_together((*ex.plan.select(n, key, ex.store.num_layers),
                                          jax.random.key_data(key)))
    keys = K.micro_keys(key, n)
    losses, d, hosts, stash, x, _ = forward_sweep(ex, batch, keys, layers, t0, idx)
    rule = ex.plan.rule
    later = bool(rule.cross or rule.along)  # estimates wait for every unit's share
    c = deferred.Combine.of(rule=rule.name, key=key, n=n, d=d, totals={}, idx=idx, depth=depth,
                            total_size=total_size(ex, layers), key_data=key_data)
    shares = Shares(ex, c, keys, later, later and commit_lazy and ex.cfg.update == "lazy", sink)
    reverse_sweep(ex, layers, hosts, stash, jax.tree.map(lambda a: a[idx], x), True,
                  shares.finish, t0)
    loss = float(np.mean(losses))
    return (loss, shares.after(batch, layers, hosts, t0)) if later else (loss, {})


@dataclasses.dataclass
class Shares:
    """A hybrid's per-unit results of the reverse sweep: each unit's estimate handed to
    ``sink`` at once, or (``later``) its share of the rule's sums and its group mean h_u
    written on the host worker (to the carry space when ``defer``)."""

    ex: Any
    c: deferred.Combine
    keys: Any
    later: bool
    defer: bool
    sink: Callable
    partials: list = dataclasses.field(default_factory=list)  # device values
    sq: list = dataclasses.field(default_factory=list)  # ‖h_u‖² per unit, device scalars
    tasks: dict = dataclasses.field(default_factory=dict)  # unit -> (slot, write future)

    def __post_init__(self):
        self.common = self.c.common()  # what every unit's share reads: formed once per step

    def finish(self, u: Any, g: Any, p: Any) -> None:
        """One unit's per selected micro-batch gradients ``g`` (device values), reduced
        there and handed to the host worker as they are."""
        ex, c = self.ex, self.c
        est, h_u, part, sq_u = K.unit_share(ex.plan.rule, ex.spec, K.shapes(p), self.later, g,
                                            c.member(u), K.seg_keys(self.keys, u), c.d,
                                            self.common)
        if not self.later:
            return self.sink(u, est, p)
        self.partials.append(part)
        self.sq.append(sq_u)
        if self.defer:
            slot = deferred.carry_slot(ex.pending.records, u)
            self.tasks[u] = (slot, ex.queue.write_carry(u, h_u, slot))
        else:
            self.tasks[u] = (None, ex.queue.write_scratch(u, h_u))

    def carried(self) -> dict:
        """Waits for every h_u write (a failed one raises): unit -> (carry slot, crcs)."""
        out = {}
        for u, (slot, task) in self.tasks.items():
            futs, crcs = task.result() if self.defer else (task.result(), None)
            for f in futs:
                f.result()
            out[u] = (slot, crcs)
        return out if self.defer else {}

    def after(self, batch: dict, layers: list, hosts: dict, t0: float) -> dict:
        """The rule's totals (one transfer), the sweep along h / ‖h‖ where the rule needs
        it, then the update sweep — or, deferred, the pending records it returns."""
        ex, carried = self.ex, self.carried()
        totals, sq_sum = read_together((K.total(self.partials), K.total(self.sq)))
        d, scale = self.c.d, None
        if ex.plan.rule.along:  # a forward sweep along u = h / ‖h‖ gives d_n = ∇L_n·u
            scale = 1.0 / max(float(np.sqrt(sq_sum)), 1e-30)
            d = along_sweep(ex, batch, layers, hosts, t0, scale, carried)[:, None]
        c = dataclasses.replace(self.c, d=np.asarray(d, np.float32), scale=scale,
                                totals={k: np.asarray(v) for k, v in totals.items()})
        if self.defer:
            return {str(u): [c.encode(*carried[u])] for u in ["embed", *layers, "head"]}
        combine_sweep(ex, layers, hosts, self.sink, t0, c)
        return {}


def reverse_sweep(ex: Any, layers: list, hosts: dict, stash: dict, sel: dict, mixes: bool,
                  finish: Callable, t0: float) -> Any:
    """Head → blocks → embed on the driver: each unit's exact gradients (per selected
    micro-batch with ``mixes``, else their mean) handed to ``finish(address, gradient, host
    params)``. The head and embed are the forward sweep's copies; blocks are read as staged
    (the forward sweep's last one is still resident). Returns the head's per-example losses
    (mean gradients) or None."""
    h_in = ex.placement.bring(stash["head"])
    s = jax.tree.leaves(sel)[0].shape[0]
    rhosts: dict = {}
    out: list = [None]

    def end(u, loaded, state):
        rhosts[u] = loaded[0]
        if u == HEAD:
            if mixes:
                _, g, ct = K.head_vjp_each(ex.stack, loaded[1], h_in, sel)
            else:
                out[0], g, ct = K.head_loss_vjp(ex.stack, loaded[1], h_in, sel,
                                                jnp.full((s,), 1.0 / s, jnp.float32))
            return (ct,), [(u, g)]
        (ct,) = state
        g = (K.embed_vjp_each if mixes else K.embed_vjp)(ex.stack, loaded[1], sel["x"], ct)
        return state, [(u, g)]

    def blocks(u, loaded, state):
        rhosts[u] = loaded[0]
        return ex.placement.vjp(loaded[1], u, stash, state, mixes)

    def done(finished):
        for v, g in finished:
            ex._each(v, g, rhosts.pop(v), finish)

    ex._drive(layers, lambda u: _rload(ex, hosts, stash, u), t0, "reverse", end, blocks, done,
              reverse=True)
    return None if out[0] is None else host_value(out[0])


def _rload(ex: Any, hosts: dict, stash: dict, u: Unit) -> tuple[Any, Any]:
    """(host, device) params of a unit for the reverse sweep: the forward sweep's last block
    unit as it is resident (no read), other blocks as staged, the ends the forward's copies;
    a block's stashed inputs readied by the placement."""
    if u.is_block:
        ex.placement.prepare_reverse(u, stash)
    if u.is_block and ex._resident is not None and ex._resident[0] == u:
        _, hosts_u, dev = ex._resident
        ex._resident = None
        ex._reused += len(u.layers)
        return hosts_u, dev
    if u.is_block:
        hs = ex._block_hosts(u, staged=True)
        return hs, ex.placement.put(u, hs)
    return hosts[u.key], ex._to_device(hosts[u.key])


def plain_sweep(ex: Any, batch: dict, layers: list, t0: float) -> tuple:
    """Forward sweep without tangents, stashing every block's input (backprop):
    ``(None, hosts, stash, x)``."""
    x = ex._cast_batch(batch)
    stash, hosts = {}, {}

    def end(u, loaded, state):
        hosts[u.key], dev = loaded
        if u == EMBED:
            return (K.embed_apply(ex.stack, dev, x["x"]),), []
        stash["head"] = ex.placement.keep(state[0])
        return None, []

    ex._drive(layers, ex._keeping_last(layers), t0, "forward", end,
              lambda u, loaded, st: (ex.placement.apply(loaded[1], u, st, stash), []))
    return None, hosts, stash, x


def total_size(ex: Any, layers: list) -> float:
    """The model's parameter count (a combine rule's shrinkage reads it), from the store's
    leaf table: no layer is read for it."""
    n = ex.store.unit_sizes()
    return float(n["embed"] + n["head"] + (n["blocks"] * ex.store.num_layers if layers else 0))
