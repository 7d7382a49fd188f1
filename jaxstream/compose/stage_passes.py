"""The per-micro-batch passes a composed stage runs (one layer per stage, the micro-batches'
examples split over ``data``), and their compiled programs, shared per mesh, model and
tangents.

Each pass factory returns ``(fn(p, stage_aux, consts, state, aux) -> (state, emit), specs)``
for :func:`jaxstream.compose.pipe.build_pipe` (a GPipe pass of a chunk) and
:class:`jaxstream.compose.circular.Circular` (the circular schedule's windows); the kernels are
the segment kernels of :mod:`jaxstream.grad.segments`, applied per micro-batch.

Example::

    run = compiled(mesh, stack, spec, "jvp", (("num_slots", 0),))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstream.comm.dataparallel import ShardRows
from jaxstream.compose.circular import Circular
from jaxstream.compose.pipe import DATA, STAGE, build_pipe
from jaxstream.grad import segments as sg
from jaxstream.models.stack import Stack

ACT = P(None, DATA)  # (N, B, ...)
TAN = P(None, None, DATA)  # (N, K, B, ...)
STASH = P(STAGE, None, DATA)  # (M, S, B, ...)


@functools.lru_cache(maxsize=256)
def circular(mesh: Mesh, stack: Stack, spec: Any, name: str, kw: tuple, chains: int) -> Circular:
    """The circular programs of the pass ``name`` for ``chains`` chains (shared as :func:`compiled`)."""
    kw = dict(kw)
    fn, specs = PASSES[name](stack, spec, **kw)
    opts = {k: v for k, v in kw.items() if k in ("num_slots", "emit_sum", "reverse")}
    return Circular(mesh, fn, chains=chains, **specs, **opts)


@functools.lru_cache(maxsize=256)
def compiled(mesh: Mesh, stack: Stack, spec: Any, name: str, kw: tuple) -> Callable:
    """The jitted pass ``name`` (shared by every executor with the same mesh, model and
    tangents, so a new store or executor compiles nothing again)."""
    kw = dict(kw)
    fn, specs = PASSES[name](stack, spec, **kw)
    opts = {k: v for k, v in kw.items() if k in ("num_slots", "emit_sum", "reverse")}
    return build_pipe(mesh, fn, **specs, **opts)


@functools.partial(jax.jit, static_argnums=1)
def _row(a: jax.Array, i: int) -> jax.Array:
    """Row ``i`` of ``a``, on ``a``'s device (jitted: no eager op per layer)."""
    return a[i]


def stage_part(a: jax.Array, i: int) -> jax.Array:
    """Entry ``i`` of the leading (stage) axis of ``a``, on the one device whose shard holds
    it (no gathered chunk; the host worker reads it)."""
    for sh in a.addressable_shards:
        rows = sh.index[0] if sh.index else slice(None)
        lo, hi = rows.start or 0, a.shape[0] if rows.stop is None else rows.stop
        if sh.replica_id == 0 and lo <= i < hi:
            return _row(sh.data, i - lo)  # a device value: materialised on the host worker
    raise ValueError(f"no shard of an array of shape {a.shape} holds entry {i}")


DEFAULT_IMPL = "threefry2x32"


# ---------------------------------------------------------------------- per-micro-batch passes
# Each returns (fn(p, stage_aux, consts, state, aux) -> (state, emit), specs for build_pipe).
def _jvp(stack, spec, num_slots=0, impl=DEFAULT_IMPL):
    def fn(p, layer, _, state, kd):
        h, dh = state
        key = jax.random.wrap_key_data(kd, impl=impl)
        return sg.block_jvp(stack, spec, p, layer, h, dh, key), h
    return fn, {"state_specs": (ACT, TAN), "aux_specs": P(), "emit_specs": STASH}


def _rows(spec):
    """Activation tangents drawn for the whole batch, of which this replica keeps its rows (as
    the in-memory estimator draws them): the segment kernels run with this sampler."""
    return ShardRows.of(spec, DATA, jax.lax.axis_size(DATA))


def _act(stack, spec, impl=DEFAULT_IMPL):
    def fn(p, layer, _, state, kd):
        h, dh = state
        key = jax.random.wrap_key_data(kd, impl=impl)
        return sg.block_act(stack, _rows(spec), p, layer, h, dh, key), ()
    return fn, {"state_specs": (ACT, TAN), "aux_specs": P(), "emit_specs": ()}


def _act_grad(stack, spec, num_examples, emit_sum=True, impl=DEFAULT_IMPL):
    def fn(p, layer, _, state, aux):
        (h,), (kd, d) = state, aux
        key = jax.random.wrap_key_data(kd, impl=impl)
        out, g = sg.act_grad(lambda pp: stack.block(pp, h), p, _rows(spec), key, layer, d,
                             num_examples)
        return (out,), jax.lax.psum(g, DATA)
    return fn, {"state_specs": (ACT,), "aux_specs": (P(), TAN), "emit_specs": P(STAGE)}


def _local(stack, spec, num_micro, emit_sum=True, weights=False, impl=DEFAULT_IMPL):
    """The shard's estimate of its mean local loss (activity, or LG-FG-W with ``weights``),
    averaged over the replicas and summed over the micro-batches."""
    def fn(p, layer, head, state, aux):
        (h,), (kd, b) = state, aux
        key = jax.random.wrap_key_data(kd, impl=impl)
        example = lambda lg: stack.example_loss(lg.astype(jnp.float32), b)
        out, g = sg.local_grad(stack, lambda pp: stack.block(pp, h), p,
                               spec if weights else _rows(spec), key, layer, head, example,
                               weights)
        return (out,), jax.tree.map(lambda a: a / num_micro, jax.lax.pmean(g, DATA))
    return fn, {"state_specs": (ACT,), "aux_specs": (P(), ACT), "emit_specs": P(STAGE)}


def _local_exact(stack, spec, num_micro, emit_sum=True):
    """The local guess's direction: the exact gradient of the layer's mean local loss (shared
    head, or its own local head), averaged over the replicas and the micro-batches."""
    from jaxstream.grad.local_guess import _guess_kernel

    def fn(p, layer, head, state, b):
        (h,) = state
        example = lambda lg: stack.example_loss(lg.astype(jnp.float32), b)
        out, g = _guess_kernel(stack, head, example)(lambda pp: stack.block(pp, h), p, layer)
        return (out,), jax.tree.map(lambda a: a / num_micro, jax.lax.pmean(g, DATA))
    return fn, {"state_specs": (ACT,), "aux_specs": ACT, "emit_specs": P(STAGE)}


def _vjp(stack, spec, num_slots=0, emit_sum=False, reverse=True):
    def fn(p, stash, _, state, i):
        (ct,) = state
        out, pull = jax.vjp(stack.block, p, stash[i])
        gp, gh = pull(ct.astype(out.dtype))
        return (gh,), jax.lax.psum(gp, DATA)
    return fn, {"state_specs": (ACT,), "aux_specs": P(), "stage_aux_specs": STASH,
                    "emit_specs": P(STAGE)}


def _along(stack, spec):
    def fn(p, v, _, state, __):
        h, dh = state
        return sg.block_jvp_along(stack, p, v, h, dh), ()
    return fn, {"state_specs": (ACT, ACT), "aux_specs": P(), "emit_specs": ()}


def _apply(stack, spec, num_slots=0):
    def fn(p, layer, _, state, __):
        (h,) = state
        return (stack.block(p, h),), h
    return fn, {"state_specs": (ACT,), "aux_specs": P(), "emit_specs": STASH}


PASSES = {"jvp": _jvp, "act": _act, "act_grad": _act_grad, "local": _local,
           "local_exact": _local_exact, "vjp": _vjp, "along": _along, "apply": _apply}
