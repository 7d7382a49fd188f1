"""The pipeline's jitted step: the table's ticks as one shard_map'd scan over the ``stage``
axis — each tick a switch over the stage ops its row needs (:func:`_branches`), the carry of
activations, tangents and cotangents passed to the next stage by ``ppermute`` — and the
estimate formed from the stages' partial sums. :mod:`jaxstream.pipeline.executor` checks a
plan against a table and calls :func:`run_step`."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import PartitionSpec as P

from jaxstream.grad import combine as cb
from jaxstream.grad import corrections as cr
from jaxstream.grad.tangents import micro_key
from jaxstream.models.stack import loss_dtype
from jaxstream.pipeline.lowering import Lowered, Row
from jaxstream.pipeline.stage_ops import StageOps
from jaxstream.pipeline.table import BW, FBW, IDLE, B, F, W

if TYPE_CHECKING:
    from jaxstream.pipeline.executor import Pipeline

AXIS = "stage"


class PipelineCarry(NamedTuple):
    """What a stale (delayed) table needs from the previous step.

    Attributes:
      params: the previous step's params (the stale exact gradients are taken there).
      stash: (M * (P+1), b, ...) per stage, the stage inputs of the previous step's selected
        micro-batches (P of them, plus a scratch slot).
      micro: the previous step's selected micro-batches (leading axis P+1, last is padding).
      valid: 0.0 before the first step (no previous step: h = 0), else 1.0.
    """

    params: Any
    stash: jax.Array
    micro: Any
    valid: jax.Array



def _param_specs():
    return {"embed": P(), "blocks": P(AXIS), "head": P()}


def _branches(pipe: Pipeline, ops: StageOps, params, prev_params, dshape, direction=None):
    """One function per (kind, position, stale) used by the table; all return the same tuple.

    An F op is the pass's own (:meth:`StageOps.forward_op`); an FBW op (F, loss, B and W of an
    exact chain in one) runs the weights' tangents, or along ``direction`` when given."""
    f_ops = {F: ops.forward_op(pipe.plan.forward_pass, direction),
             FBW: ops.forward_op(None, direction)}

    def build(kind, pos, stale):
        def fn(x):
            h_in, t_in, c_in, bj, kj, sbj, sh = x
            hz = jnp.zeros_like(h_in)
            acc = _acc(params)
            out = {"h": hz, "t": jnp.zeros_like(t_in), "c": hz,
                   "g": jax.tree.map(jnp.zeros_like, params),
                   "loss": jnp.zeros((), acc), "d": jnp.zeros(dshape, acc)}
            if kind in f_ops:
                inp = bj["x"] if pos in ("first", "only") else h_in
                a, b, g = f_ops[kind](pos, params, inp, t_in, kj, bj)
                passes_on = pos in ("first", "mid")
                out["h" if passes_on else "loss"] = a
                if b is not None:
                    out["t" if passes_on else "d"] = b
                if g is not None:
                    out["g"] = g
            if kind in (B, W, BW, FBW):
                p = prev_params if stale else params
                data = sbj if stale else bj
                inp = data["x"] if pos in ("first", "only") else (sh if stale else h_in)
                gi, gp = ops.backward(pos, p, inp, c_in, data, want_input=kind in (B, BW, FBW),
                                      want_weights=kind in (W, BW, FBW))
                if gi is not None and pos != "first":
                    out["c"] = gi.astype(hz.dtype)
                out["g"] = gp
            out["loss"] = jnp.asarray(out["loss"], acc)
            out["d"] = jnp.asarray(out["d"], acc)
            return out["h"], out["t"], out["c"], out["g"], out["loss"], out["d"]

        return fn

    return [build(*b) if b[0] != IDLE else build(IDLE, "any", False) for b in pipe.lowered.branches]


def run_step(pipe: Pipeline, params, batch, key, carry, guess=None, along_pass: bool = False):
    """One call of the compiled step (``along_pass``: the local guess's pass along ``guess``)."""
    low, m = pipe.lowered, pipe.schedule.num_stages
    if carry is None:  # a dummy, so that one body serves every table
        x0 = jax.tree.map(lambda a: a[0], batch)["x"]
        hsd = jax.eval_shape(pipe.stack.embed, params["embed"], x0)
        carry = PipelineCarry(
            params, jnp.zeros((m, *hsd.shape), hsd.dtype),
            jax.tree.map(lambda a: jnp.zeros((1, *a.shape[1:]), a.dtype), batch),
            jnp.ones((), jnp.float32))
    name = "along" if along_pass else "fn"
    if name not in pipe._compiled:
        pipe._compiled[name] = _build(pipe, along_pass)
    groups = low.groups.astype(np.float32).reshape(m, len(low.selected))
    sched = pipe.schedule
    ain_w = np.where(sched.kind == F, sched.micro, sched.micro_batches).astype(np.int32)
    direction = params if guess is None else guess  # a stand-in when there is no direction
    has_dir = jnp.float32(guess is not None)
    args = (params, batch, jax.random.key_data(key), low.tables, ain_w, groups, carry,
            direction, has_dir)
    shardings = _shardings(pipe.mesh, args)
    if jax.process_count() == 1:  # same input shardings every call: one compilation
        args = jax.device_put(args, shardings)
    else:  # several processes: host values (the same on every process) become global arrays
        args = jax.tree.map(_to_global, args, shardings)
    # the key travels as raw data; its implementation is a static argument of the step
    impl = str(jax.random.key_impl(key))
    loss, grads, d, ns, h = pipe._compiled[name](*args, impl=impl)
    aux = {"directional": d, "exact_indices": low.selected, "stale": low.stale}
    if pipe.along:
        aux["direction"] = h
    if low.stale:
        prev_idx = np.array(low.prev_selected, np.int32)
        micro = jax.tree.map(
            lambda a: jnp.concatenate([a[prev_idx], jnp.zeros_like(a[:1])]), batch)
        aux["carry"] = PipelineCarry(params, ns, micro, jnp.ones((), jnp.float32))
    return loss, grads, aux


def _to_global(x, sharding):
    """A global array from a value every process holds in full (kept if already global)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def _in_specs():
    pspec = _param_specs()
    return (pspec, P(), P(), P(None, AXIS), P(None, AXIS), P(AXIS),
            PipelineCarry(pspec, P(AXIS), P(), P()), pspec, P())


def _shardings(mesh, args):
    """NamedShardings of the executor's inputs (params' blocks and the stash split by stage)."""
    def to(spec, tree):
        return jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, spec), tree)

    specs = _in_specs()
    out = []
    for spec, arg in zip(specs, args):
        if isinstance(spec, P):
            out.append(to(spec, arg))
        elif isinstance(spec, PipelineCarry):
            out.append(PipelineCarry(*(_shardings_dict(mesh, s, a) for s, a in zip(spec, arg))))
        else:
            out.append(_shardings_dict(mesh, spec, arg))
    return tuple(out)


def _shardings_dict(mesh, spec, arg):
    if isinstance(spec, P):
        return jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, spec), arg)
    return {k: _shardings_dict(mesh, spec[k], arg[k]) for k in arg}


class TickCarry(NamedTuple):
    """What a stage carries from one tick to the next (the ``lax.scan`` carry).

    Attributes:
      h: (h_slots + 1, b, ...) ring buffer of stage inputs (the last slot is scratch).
      t: (t_slots + 1, K, b, ...) ring buffer of input tangents.
      c: (c_slots + 1, b, ...) ring buffer of output cotangents.
      stash: (P + 1, b, ...) this step's inputs of the micro-batches the next step corrects.
      inputs: (N + 1, b, ...) every micro-batch's stage input (activity perturbation only).
      g: exact-gradient accumulators, one row per selected micro-batch (+ scratch).
      d: (N + 1, K[, b]) directional derivatives (the last stage writes them).
      loss: (N + 1,) per micro-batch losses (the last stage writes them).
      h_next, t_next, c_next: what arrives next tick (sent up / down this tick).
    """

    h: jax.Array
    t: jax.Array
    c: jax.Array
    stash: jax.Array
    inputs: jax.Array
    g: Any
    d: jax.Array
    loss: jax.Array
    h_next: jax.Array
    t_next: jax.Array
    c_next: jax.Array


def _tick(pipe: Pipeline, fns: list, batch, carry: PipelineCarry, key, *, activity: bool,
          accumulate: bool):
    """The scan body: store what arrived, run the cell's op under ``lax.switch``, record its
    outputs, send activations up and cotangents down (outside the switch)."""
    m = pipe.schedule.num_stages
    up, down = [(i, i + 1) for i in range(m - 1)], [(i + 1, i) for i in range(m - 1)]

    def tick(c: TickCarry, xs) -> tuple[TickCarry, None]:
        r, aw = Row(*xs[0]), xs[1]
        hbuf = c.h.at[r.h_w].set(c.h_next)
        tbuf = c.t.at[r.t_w].set(c.t_next)
        cbuf = c.c.at[r.c_w].set(c.c_next)
        h_in = hbuf[r.h_r]
        bj = jax.tree.map(lambda a: a[r.mb], batch)
        sbj = jax.tree.map(lambda a: a[r.pm_r], carry.micro)
        h_o, t_o, c_o, g, loss, d = jax.lax.switch(
            r.branch, fns, (h_in, tbuf[r.t_r], cbuf[r.c_r], bj, micro_key(key, r.mb), sbj,
                            carry.stash[r.pm_r]))
        gacc = jax.tree.map(lambda a, x: a.at[r.g_w].add(x), c.g, g) if accumulate else c.g
        c_next = jax.lax.ppermute(c_o, AXIS, down) if pipe.lowered.backward else c.c_next
        return TickCarry(
            hbuf, tbuf, cbuf, c.stash.at[r.ns_w].set(h_in),
            c.inputs.at[aw].set(h_in) if activity else c.inputs,  # for the weight estimates
            gacc, c.d.at[r.d_w].set(d), c.loss.at[r.d_w].set(loss),
            jax.lax.ppermute(h_o, AXIS, up), jax.lax.ppermute(t_o, AXIS, up), c_next), None

    return tick


def _build(pipe: Pipeline, along_pass: bool = False):
    """The jitted shard_map'd step of a pipeline (built once, traced per input shapes);
    ``along_pass``: the local guess's second pass, derivatives along a given direction only."""
    low, sched, spec = pipe.lowered, pipe.schedule, pipe.spec
    m, n, kt = sched.num_stages, sched.micro_batches, spec.num
    per = pipe.stack.num_layers // m
    fp = pipe.plan.forward_pass
    activity = fp.tangents == "activations" and not fp.local_losses
    local = fp.local_losses and not along_pass
    guess = pipe.along or along_pass
    if guess:
        kt = 1  # one derivative per micro-batch, along the given direction

    def body(params, batch, key_data, tables, ain_w, groups, carry, direction, has_dir, *, impl):
        key = jax.random.wrap_key_data(key_data, impl=impl)
        x0 = jax.tree.map(lambda a: a[0], batch)["x"]
        hsd = jax.eval_shape(pipe.stack.embed, params["embed"], x0)
        dshape = (kt, x0.shape[0]) if activity else (kt,)  # per-example scalars for activities
        s = jax.lax.axis_index(AXIS)
        ops = StageOps(pipe.stack, spec, s * per)
        owned = {"embed": (s == 0).astype(jnp.float32), "head": (s == m - 1).astype(jnp.float32)}
        u = cb.unit_direction(direction, lambda t: jax.lax.psum(t, AXIS), owned) if guess else None
        fns = _branches(pipe, ops, params, carry.params, dshape, u)  # (along u, if given)
        tick = _tick(pipe, fns, batch, carry, key, activity=activity,
                     accumulate=low.backward or local)
        init = _buffers(low, params, hsd, kt, n, dshape, n if activity else 0)
        out, _ = jax.lax.scan(tick, init, (tables[:, 0], ain_w[:, 0]))
        last = (s == m - 1).astype(jnp.float32)
        d = jax.lax.psum(out.d[:n] * last, AXIS)
        losses = jax.lax.psum(out.loss[:n] * last, AXIS)
        keys = jax.vmap(lambda i: micro_key(key, i))(jnp.arange(n))
        h = None
        if local:  # each F op formed its stage's local estimates
            grads = jax.tree.map(lambda a: a[0] / n, out.g)
        elif along_pass:  # the derivatives d are the result
            grads = jax.tree.map(jnp.zeros_like, params)
        elif activity:
            first = (s == 0).astype(jnp.float32)
            grads = jax.tree.map(lambda a: a.sum(0) / n, jax.lax.map(
                lambda xs: ops.activity_grads(params, xs[0], xs[1], xs[2], xs[3], first, last),
                (batch["x"], out.inputs[:n], keys, d)))
            d = jnp.zeros((n, kt), _acc(params))  # the per-example scalars stay inside
        else:
            grads, h = _estimate(pipe, params, out.g, groups[0], d, keys, s * per, carry.valid,
                                 owned, u, has_dir)
        h = _gather(h, s, m) if pipe.along else jnp.zeros(())
        return jnp.mean(losses), _gather(grads, s, m), d, out.stash, h

    def step(*args, impl: str):
        fn = shard_map(functools.partial(body, impl=impl), mesh=pipe.mesh, in_specs=_in_specs(),
                       out_specs=(P(), _param_specs(), P(), P(AXIS),
                                  _param_specs() if pipe.along else P()), check_vma=False)
        return fn(*args)

    return jax.jit(step, static_argnames="impl")


def _acc(params) -> Any:
    """The dtype of losses and scalars d: the parameters' promoted to at least float32."""
    return loss_dtype(jax.tree.leaves(params)[0].dtype)


def _buffers(low: Lowered, params, hsd, kt: int, n: int, dshape: tuple,
             num_inputs: int) -> TickCarry:
    """The initial :class:`TickCarry` (``num_inputs``: N for activity perturbation, else 0)."""
    hshape, hdtype = hsd.shape, hsd.dtype
    z = lambda *shape: jnp.zeros(shape, hdtype)
    return TickCarry(
        z(low.h_slots + 1, *hshape), z(low.t_slots + 1, kt, *hshape), z(low.c_slots + 1, *hshape),
        z(len(low.prev_selected) + 1, *hshape), z(num_inputs + 1, *hshape),
        jax.tree.map(lambda a: jnp.zeros((len(low.selected) + 1, *a.shape), a.dtype), params),
        jnp.zeros((n + 1, *dshape), _acc(params)), jnp.zeros((n + 1,), _acc(params)),
        z(*hshape), z(kt, *hshape), z(*hshape),
    )


def _gather(t: dict, s, m: int) -> dict:
    """Embed and head terms from the stage that computes them (first / last), on every stage."""
    on = {"embed": (s == 0), "head": (s == m - 1)}
    keep = lambda g, here: g * here.astype(g.dtype)
    return {"embed": jax.tree.map(lambda g: jax.lax.psum(keep(g, on["embed"]), AXIS), t["embed"]),
            "blocks": t["blocks"],
            "head": jax.tree.map(lambda g: jax.lax.psum(keep(g, on["head"]), AXIS), t["head"])}


def _reached(low: Lowered) -> jax.Array:
    """(S,) 1 for each selected micro-batch whose chain reaches some stage (the head's group
    of the whole model)."""
    return jnp.asarray(np.asarray(low.groups).any(0), jnp.float32)


def _estimate(pipe: Pipeline, params, gacc, group_row, d, keys, first_layer, valid, owned,
              direction, has_dir):
    """(this stage's estimate, its group mean h) by the plan's combine rule, the rule's partial
    sums reduced over the stages (``psum``). Before the first step of a stale table ``valid``
    is 0: empty groups, h = 0."""
    plan, low, n = pipe.plan, pipe.lowered, d.shape[0]
    # with every micro-batch exact (backprop's plan), ``replace`` is the exact mean
    rule = cb.REPLACE if plan.exact == "all" else plan.rule
    stats = cb.Stats(pipe.spec, keys, d, params, first_layer, owned=owned)
    if rule.exact:
        n_sel = len(low.selected)
        exact = jax.tree.map(lambda a: a[:n_sel] * valid, gacc)
        group_row = group_row * valid
        num_local = jax.tree.leaves(params["blocks"])[0].shape[0]
        masks = {"embed": group_row, "head": group_row,
                 "blocks": jnp.broadcast_to(group_row[:, None], (n_sel, num_local))}
        h, counts = cb.group_stats(exact, masks, params)
        sel = jnp.array(low.selected, jnp.int32)
        # a stale exact gradient is of another step's micro-batch: every residual of this step
        # is still estimated by tangents
        member = jax.tree.map(jnp.zeros_like, masks) if low.stale else masks
        sizes = cr.segment_sizes(params)  # this stage's blocks; embed and head in full
        stats = stats._replace(
            h=h, counts=counts, rows=cr.outside_rows(member, sel, n),
            outside=cr.outside_rows({"tree": _reached(low) * (0.0 if low.stale else 1.0)}, sel,
                                    n)["tree"],
            total_size=sizes["embed"] + sizes["head"] + sizes["blocks"][0] * pipe.stack.num_layers,
            direction=direction, has_direction=has_dir)
    grads = cb.combine(rule, stats, lambda t: jax.lax.psum(t, AXIS))
    return grads, stats.h
