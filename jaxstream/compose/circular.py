"""A circular (looping) pass of a whole sweep over a ``data × stage`` mesh, one chunk at a time.

A sweep's L layers are cut into C chunks of M (one layer per stage). Instead of one GPipe pass
per chunk (:mod:`.pipe`, M − 1 idle ticks per chunk), the chains of every chunk run back to back
with period P = max(n, M) for n chains (micro-batches): the stage at position r (the stage
itself; M − 1 − stage for a reverse sweep) runs chain j of chunk k at tick kP + j + r. The last
position hands each chain's output round the ring to position 0, which keeps it in a buffer
until chunk k + 1 takes it (P ≥ M ticks later). So the sweep takes C·P + max(0, n + M − 1 − P)
ticks — one fill and one drain, (M − 1)/(C·P + M − 1) idle for n ≥ M, and L + n − 1 ticks for
n ≤ M chains (M chains of a reverse sweep for the ticks of about one).

The host feeds the pass one chunk at a time (the program does not grow with depth): *window* k
runs ticks [kP, (k + 1)P) with two layers per stage resident — chunk k − 1's, whose last chains
are still draining at the later positions, and chunk k's — and returns chunk k − 1's emits,
complete. A *tail* window drains the last chunk. Between windows the pipeline's state (position
0's buffer of chains, what every stage received last tick, the running chunk's emits) stays on
the devices. ``fn`` and the specs are those of :func:`jaxstream.compose.pipe.build_pipe`.

Example::

    w = Circular(mesh, fn, state_specs=(P(None, "data"),), aux_specs=P(), chains=8)
    carry = w.begin(params0, (h,), keys, layers0, (), slots)
    carry, _, (busy, ticks) = w.window(params0, params0, carry, keys, layers0, layers0, (),
                                       slots, has_prev=False)
    ...                                               # one window per further chunk, then
    carry, em_last, counts = w.tail(last, carry, keys, last_layers, (), slots)
    (h,) = w.end(carry)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstream.compose.peers import Together
from jaxstream.compose.pipe import BY_STAGE, STAGE, WHOLE

_is_spec = lambda x: isinstance(x, P)


def _staged(specs: Any, drop: int = 0) -> Any:
    """Specs with a leading stage axis (and the first ``drop`` axes of each removed)."""
    return jax.tree.map(lambda s: P(STAGE, *tuple(s)[drop:]), specs, is_leaf=_is_spec)


def circular_ticks(chains: int, stages: int, chunks: int) -> tuple[int, int]:
    """(period, ticks) of a circular sweep of ``chains`` chains over ``chunks`` chunks."""
    period = max(chains, stages)
    return period, chunks * period + max(0, chains + stages - 1 - period)


class Circular:
    """The programs of one circular sweep shape (see the module docstring).

    Args:
      mesh: a ``("data", "stage")`` mesh.
      fn: the per-chain, per-stage function ``fn(p, stage_aux, consts, state, aux) ->
        (state', emit)``.
      state_specs / aux_specs / stage_aux_specs / const_specs / emit_specs: as for
        :func:`~jaxstream.compose.pipe.build_pipe`.
      chains: n, the chains of the sweep (micro-batches, or the selected ones).
      num_slots / emit_sum: how emits are kept (per slot, or summed over chains).
      reverse: cotangents flow from the last stage to the first.
    """

    def __init__(self, mesh: Mesh, fn: Callable, *, state_specs: Any, aux_specs: Any,
                 chains: int, stage_aux_specs: Any = BY_STAGE, const_specs: Any = WHOLE,
                 emit_specs: Any = BY_STAGE, num_slots: int = 0, emit_sum: bool = False,
                 reverse: bool = False):
        self.mesh, self.fn, self.n, self.m = mesh, fn, chains, mesh.shape[STAGE]
        self.period, _ = circular_ticks(chains, self.m, 1)
        self.tail_ticks = max(0, chains + self.m - 1 - self.period)
        self.num_slots, self.emit_sum, self.reverse = num_slots, emit_sum, reverse
        carry = (_staged(state_specs), _staged(state_specs, 1), emit_specs)
        self.carry_specs = carry
        sm = functools.partial(shard_map, mesh=mesh, check_vma=False)
        self.begin = Together(jax.jit(sm(self._begin, in_specs=(
            P(STAGE), state_specs, aux_specs, stage_aux_specs, const_specs, P()),
            out_specs=carry)))
        win_in = (P(STAGE), P(STAGE), carry, aux_specs, stage_aux_specs, stage_aux_specs,
                  const_specs, P(), P())
        win_out = (carry, emit_specs, (P(STAGE), P(STAGE)))
        self._win = Together(jax.jit(sm(functools.partial(self._window, ticks=self.period),
                                        in_specs=win_in, out_specs=win_out)))
        self._tail = Together(jax.jit(sm(functools.partial(self._window, ticks=self.tail_ticks),
                                         in_specs=win_in, out_specs=win_out)))
        self.end = Together(jax.jit(sm(self._end, in_specs=(carry,), out_specs=state_specs)))

    # ------------------------------------------------------------------ host entry points
    def window(self, prev, cur, carry, mb_aux, prev_aux, cur_aux, consts, slots, has_prev: bool):
        """Window k: ``(carry, chunk k − 1's emits (complete), (busy, ticks))``: per stage, the
        ticks it computed and the ticks the window ran, counted as they run."""
        flags = np.asarray([int(has_prev), 1], np.int32)  # a host value: no eager op
        return self._win(prev, cur, carry, mb_aux, prev_aux, cur_aux, consts, slots, flags)

    def tail(self, last, carry, mb_aux, last_aux, consts, slots):
        """The drain of the last chunk: ``(carry, its emits, (busy, ticks))``; nothing runs
        (None) when its chains finished inside its window (the carry's emits are returned)."""
        if not self.tail_ticks:
            return carry, carry[2], None
        flags = np.asarray([1, 0], np.int32)
        return self._tail(last, last, carry, mb_aux, last_aux, last_aux, consts, slots, flags)

    # ------------------------------------------------------------------ device programs
    def _position(self):
        s = jax.lax.axis_index(STAGE)
        return (self.m - 1 - s) if self.reverse else s

    def _emit_zeros(self, params, states, mb_aux, stage_aux, consts):
        first = lambda t: jax.tree.map(lambda a: a[0], t)
        _, sd = jax.eval_shape(self.fn, first(params), first(stage_aux), consts, first(states),
                               first(mb_aux))
        lead = () if self.emit_sum else (max(self.num_slots, 1),)
        return jax.tree.map(lambda e: jnp.zeros((1,) + lead + e.shape, e.dtype), sd)

    def _begin(self, params, states, mb_aux, stage_aux, consts, slots):
        buf = jax.tree.map(lambda a: a[None], states)
        recv = jax.tree.map(lambda a: jnp.zeros_like(a[:1, 0]), buf)
        return buf, recv, self._emit_zeros(params, states, mb_aux, stage_aux, consts)

    def _end(self, carry):
        buf = carry[0]
        first = self._position() == 0
        return jax.tree.map(lambda b: jax.lax.psum(jnp.where(first, b[0], jnp.zeros_like(b[0])),
                                                   STAGE), buf)

    def _op(self, tau, r, flags):
        """(chain, active, on the previous chunk) of position ``r`` at window tick ``tau``."""
        on_prev = tau < r
        j = jnp.where(on_prev, tau - r + self.period, tau - r)
        active = jnp.where(on_prev, flags[0], flags[1]).astype(bool) & (j >= 0) & (j < self.n)
        return jnp.clip(j, 0, self.n - 1), active, on_prev

    def _window(self, prev, cur, carry, mb_aux, prev_aux, cur_aux, consts, slots, flags, *,
                ticks: int):
        m = self.m
        ring = [(i, (i - 1) % m) for i in range(m)] if self.reverse else \
            [(i, (i + 1) % m) for i in range(m)]
        take = lambda t: jax.tree.map(lambda a: a[0], t)
        prev, cur, prev_aux, cur_aux = take(prev), take(cur), take(prev_aux), take(cur_aux)
        buf, recv, em_prev = take(carry[0]), take(carry[1]), take(carry[2])
        em_cur = jax.tree.map(jnp.zeros_like, em_prev)
        r = self._position()

        def keep(b, v, j, on):
            if self.emit_sum:
                return b + jnp.where(on, v, 0).astype(b.dtype)
            sl = slots[j]
            sc = jnp.clip(sl, 0, self.num_slots - 1)
            return b.at[sc].set(jnp.where(on & (sl >= 0), v, b[sc]))

        def tick(c, tau):
            buf, recv, em_prev, em_cur, busy, ran = c
            j, active, on_prev = self._op(tau, r, flags)
            pick = lambda a, b: jax.tree.map(lambda x, y: jnp.where(on_prev, x, y), a, b)
            x = jax.tree.map(lambda b, v: jnp.where(r == 0, b[j], v), buf, recv)
            y, e = self.fn(pick(prev, cur), pick(prev_aux, cur_aux), consts, x,
                           jax.tree.map(lambda a: a[j], mb_aux))
            if self.emit_sum or self.num_slots:
                em_prev = jax.tree.map(lambda b, v: keep(b, v, j, active & on_prev), em_prev, e)
                em_cur = jax.tree.map(lambda b, v: keep(b, v, j, active & ~on_prev), em_cur, e)
            sent = jax.tree.map(lambda v: jax.lax.ppermute(v, STAGE, ring), y)
            # position 0 keeps what the last position finished this tick, for the next chunk
            jl, al, _ = self._op(tau, m - 1, flags)
            put = (r == 0) & al
            buf = jax.tree.map(lambda b, v: b.at[jl].set(jnp.where(put, v, b[jl])), buf, sent)
            return (buf, sent, em_prev, em_cur, busy + active.astype(jnp.int32), ran + 1), None

        init = (buf, recv, em_prev, em_cur, jnp.int32(0), jnp.int32(0))
        (buf, recv, em_prev, em_cur, busy, ran), _ = jax.lax.scan(tick, init, jnp.arange(ticks))
        add = lambda t: jax.tree.map(lambda a: a[None], t)
        return (add(buf), add(recv), add(em_cur)), add(em_prev), (busy[None], ran[None])
