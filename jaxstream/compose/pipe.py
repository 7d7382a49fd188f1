"""A GPipe pass of one chunk of layers over a ``data × stage`` mesh.

A chunk holds one layer per stage (stage s has layer ``chunk[s]``). Its N micro-batches enter
stage 0 one per tick and move to the next stage with ``ppermute``: N + M − 1 ticks, stage s
busy at ticks s … s + N − 1 (the chunk's bubbles are the other M − 1 ticks). ``reverse`` runs
the stages from M − 1 down to 0 (a reverse chain: cotangents flow towards stage 0). Every
micro-batch's examples are split over ``data``; a function that reduces over examples (a
parameter gradient) does its own ``psum`` over :data:`DATA`.

The per-micro-batch function ``fn(p, stage_aux, consts, state, aux) -> (state', emit)`` is
any pytree map whose output state has the input's structure: the same pass runs jvp with
weight tangents, jvp with activity tangents, vjp, or a plain forward. What a stage emits for a
micro-batch (its input, for a later reverse pass; a parameter gradient) is stored in slot
``slots[n]`` (−1: not kept) or, with ``emit_sum``, summed over micro-batches.

Example::

    run = build_pipe(mesh, fn, state_specs=(P(None, "data"),), aux_specs=P())
    (h,), stash = run(stacked_params, (h,), keys, (), (), slots)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstream.compose.peers import Together

DATA, STAGE = "data", "stage"
BY_STAGE, WHOLE = P(STAGE), P()  # a leading stage axis; the same value on every device


def build_pipe(mesh: Mesh, fn: Callable, *, state_specs: Any, aux_specs: Any,
               stage_aux_specs: Any = BY_STAGE, const_specs: Any = WHOLE,
               emit_specs: Any = BY_STAGE, num_slots: int = 0, emit_sum: bool = False,
               reverse: bool = False) -> Callable:
    """The jitted pass ``(params, states, mb_aux, stage_aux, consts, slots) -> (states, emits)``.

    Args:
      mesh: a mesh with axes ``("data", "stage")``.
      fn: the per-micro-batch, per-stage function (see the module docstring).
      state_specs / aux_specs: partition specs (pytree prefixes) of the states (N, ...) and of
        the per-micro-batch inputs (N, ...), e.g. ``P(None, "data")`` for (N, B, ...).
      stage_aux_specs / const_specs: specs of per-stage inputs (M, ...) and of inputs every
        stage sees whole.
      emit_specs: specs of the emitted buffers, whose leaves get a leading stage axis.
      num_slots: slots of the emit buffer (0 with ``emit_sum``: one accumulator).
      emit_sum: sum the emits over micro-batches instead of keeping them per slot.
      reverse: run the stages from the last to the first.

    Returns:
      the pass; the states it returns are the last stage's outputs, on every stage.
    """
    m = mesh.shape[STAGE]
    fwd = [(i, i + 1) for i in range(m - 1)]
    perm = [(j, i) for i, j in fwd] if reverse else fwd

    def body(params, states, mb_aux, stage_aux, consts, slots):
        p = jax.tree.map(lambda a: a[0], params)
        sa = jax.tree.map(lambda a: a[0], stage_aux)
        s = jax.lax.axis_index(STAGE)
        pos = (m - 1 - s) if reverse else s
        n = jax.tree.leaves(states)[0].shape[0]
        first = lambda tree: jax.tree.map(lambda a: a[0], tree)
        _, emit_sd = jax.eval_shape(fn, p, sa, consts, first(states), first(mb_aux))
        lead = () if emit_sum else (max(num_slots, 1),)
        buf = jax.tree.map(lambda e: jnp.zeros(lead + e.shape, e.dtype), emit_sd)

        def tick(c, t):
            recv, outs, buf = c
            i = t - pos
            active = (i >= 0) & (i < n)
            ic = jnp.clip(i, 0, n - 1)
            x = jax.tree.map(lambda a, r: jnp.where(pos == 0, a[ic], r), states, recv)
            y, e = fn(p, sa, consts, x, jax.tree.map(lambda a: a[ic], mb_aux))
            done = active & (pos == m - 1)
            outs = jax.tree.map(lambda o, v: o.at[ic].set(jnp.where(done, v, o[ic])), outs, y)
            if emit_sum:
                buf = jax.tree.map(lambda b, v: b + jnp.where(active, v, 0).astype(b.dtype),
                                   buf, e)
            elif num_slots:
                sl = slots[ic]
                keep = active & (sl >= 0)
                sc = jnp.clip(sl, 0, num_slots - 1)
                buf = jax.tree.map(lambda b, v: b.at[sc].set(jnp.where(keep, v, b[sc])), buf, e)
            recv = jax.tree.map(lambda v: jax.lax.ppermute(v, STAGE, perm), y)
            return (recv, outs, buf), None

        init = (first(jax.tree.map(jnp.zeros_like, states)),
                jax.tree.map(jnp.zeros_like, states), buf)
        (_, outs, buf), _ = jax.lax.scan(tick, init, jnp.arange(n + m - 1))
        last = pos == m - 1
        outs = jax.tree.map(lambda o: jax.lax.psum(jnp.where(last, o, jnp.zeros_like(o)), STAGE),
                            outs)
        return outs, jax.tree.map(lambda b: b[None], buf)

    run = shard_map(body, mesh=mesh,
                    in_specs=(P(STAGE), state_specs, aux_specs, stage_aux_specs, const_specs, P()),
                    out_specs=(state_specs, emit_specs), check_vma=False)
    return Together(jax.jit(run))
