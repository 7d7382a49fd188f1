"""The circular schedule: each pass against a sequential NumPy reference (every chain through
every layer in order, each layer's emits), its executed ticks against the counts worked out by
hand in DESIGN §8, and the composed executor on it against the one-device streamed executor
on several meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, chunk_cost, make_mesh
from jaxstream.compose.circular import Circular
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, StreamConfig, StreamedExecutor
from tests.trees import max_rel_err

ACT = P(None, "data")
D, B = 3, 4


def _sweep(n, m, c, data=1, reverse=False, emit_sum=False, dim=D):
    """Runs a circular sweep of a tanh layer; returns (outputs, emits per layer, ticks, busy)
    and the NumPy reference (outputs, emits per layer)."""
    mesh = make_mesh(data, m)
    rng = np.random.default_rng(n * 100 + m * 10 + c)
    w = rng.standard_normal((c * m, dim, dim)).astype(np.float32) * 0.5
    bias = rng.standard_normal((c * m, dim)).astype(np.float32)
    h0 = rng.standard_normal((n, B, dim)).astype(np.float32)
    aux = np.arange(n, dtype=np.float32) * 0.01

    def fn(p, _, __, state, a):
        (h,) = state
        emit = jax.lax.psum(jnp.sum(h, 0), "data") if emit_sum else h
        return (jnp.tanh(h @ p["w"] + p["b"]) + a,), emit

    circ = Circular(mesh, fn, state_specs=(ACT,), aux_specs=P(), chains=n, reverse=reverse,
                    num_slots=0 if emit_sum else n, emit_sum=emit_sum,
                    emit_specs=P("stage") if emit_sum else P("stage", None, "data"))
    by_stage, slots, zero = NamedSharding(mesh, P("stage")), np.arange(n, dtype=np.int32), \
        np.zeros(m, np.int32)
    order = range(c - 1, -1, -1) if reverse else range(c)
    carry, prev, emits, ticks, busy = None, None, {}, 0, np.zeros(m, np.int64)
    for k in order:
        cur = jax.device_put({"w": w[k * m:(k + 1) * m], "b": bias[k * m:(k + 1) * m]}, by_stage)
        if carry is None:
            carry = circ.begin(cur, (jax.device_put(h0, NamedSharding(mesh, ACT)),), aux, zero,
                               (), slots)
        carry, em, (b, t) = circ.window(prev[0] if prev else cur, cur, carry, aux, zero, zero,
                                        (), slots, has_prev=prev is not None)
        ticks, busy = ticks + int(np.asarray(t)[0]), busy + np.asarray(b)
        if prev:
            emits[prev[1]] = np.asarray(em)
        prev = (cur, k)
    carry, em, counts = circ.tail(prev[0], carry, aux, zero, (), slots)
    emits[prev[1]] = np.asarray(em)
    if counts is not None:
        ticks, busy = ticks + int(np.asarray(counts[1])[0]), busy + np.asarray(counts[0])
    (out,) = circ.end(carry)

    h, ref = h0.astype(np.float64), {}
    for k in order:
        for s in (range(m - 1, -1, -1) if reverse else range(m)):
            ref[(k, s)] = h.sum((0, 1)) if emit_sum else h.copy()
            h = np.tanh(h @ w[k * m + s] + bias[k * m + s]) + aux[:, None, None]
    got = {(k, s): e[s] for k, e in emits.items() for s in range(m)}
    return (np.asarray(out), got, ticks, busy), (h, ref)


@pytest.mark.parametrize("n,m,c,data,reverse,emit_sum", [
    (8, 4, 3, 1, False, False),   # n > M: period n, a drain of M - 1 ticks
    (4, 4, 2, 2, False, True),    # n = M: the ring hands a chain over in the tick it is needed
    (2, 4, 3, 1, False, False),   # n < M: period M, stages idle M - n of every M ticks
    (3, 4, 2, 2, True, False),    # reverse chains, S < M: L + S - 1 ticks
    (8, 2, 2, 1, True, True),     # reverse, summed emits
    (3, 1, 3, 1, False, False),   # one stage
])
def test_pass_equals_sequential_layers(n, m, c, data, reverse, emit_sum):
    (out, emits, ticks, busy), (ref_out, ref) = _sweep(n, m, c, data, reverse, emit_sum)
    assert np.abs(out - ref_out).max() <= 1e-5
    assert set(emits) == set(ref) and max(np.abs(emits[k] - ref[k]).max() for k in ref) <= 1e-4
    assert busy.tolist() == [n * c] * m  # every stage ran every chain of every chunk once
    period = max(n, m)
    # the last op, chain n - 1 at the last position of chunk C - 1, is at tick
    # (C - 1) P + n - 1 + M - 1: the sweep runs no tick after it
    assert ticks == (c - 1) * period + n + m - 1 if n + m - 1 > period else ticks == c * period


def test_a_wrong_order_fails_the_comparison():
    """The comparison can fail: the same layers in the reverse order give other outputs, and
    one layer's emits are not another's."""
    (out, emits, _, _), _ = _sweep(4, 2, 2)
    _, (other_order, ref) = _sweep(4, 2, 2, reverse=True)
    assert np.abs(out - other_order).max() > 1e-2
    assert np.abs(emits[(0, 1)] - ref[(0, 0)]).max() > 1e-2


@pytest.mark.parametrize("chains,reverse,expected", [(16, False, 135), (2, True, 65),
                                                     (8, True, 71), (1, True, 64)])
def test_design_tick_counts_executed(chains, reverse, expected):
    """L = 64, M = 8, N = 16: the forward sweep and S = 1, 2, 8 reverse chains take the ticks
    DESIGN §8 counts by hand (one chain: L; M chains: L + M - 1)."""
    (_, _, ticks, busy), _ = _sweep(chains, 8, 8, reverse=reverse, dim=2)
    assert ticks == expected and busy.tolist() == [chains * 8] * 8


@pytest.mark.parametrize("mesh", [(1, 4), (2, 4), (4, 2)])  # 2 x 2: the engine matrix
def test_executor_equals_one_device(tmp_path, mesh):
    """The composed executor on the circular schedule equals the one-device streamed executor
    (itself equal to the in-memory estimators: tests/test_engine_matrix.py), and its step's
    ticks are the cost model's."""
    stack = mlp(5, 6, 8, 3)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    n = 2 if mesh == (1, 4) else 4  # (1, 4): fewer micro-batches than stages
    micro = {"x": rng.standard_normal((n, 4, 5), dtype=np.float32),
             "y": rng.integers(0, 3, (n, 4), dtype=np.int32)}
    cfg = StreamConfig(compute_dtype="float32", prefetch=1)
    est = jg.hybrid(num_exact=2, num_tangents=2, correction="control_variate")
    store = LayerStore.create(tmp_path / "s", params, optimizer=optax.sgd(0.1))
    ex = ComposedExecutor(stack, est, optax.sgd(0.1), store, cfg, mesh=make_mesh(*mesh))
    loss, grads = ex.estimate(micro, jax.random.key(3))
    ref_loss, ref = StreamedExecutor(stack, est, optax.sgd(0.1), store, cfg).estimate(
        micro, jax.random.key(3))
    assert max_rel_err(grads, ref) <= 1e-5 and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    model = chunk_cost("hybrid_cv", layers=8, stages=mesh[1], micro_batches=n, selected=2)
    assert ex.ticks == model.ticks
    busy = ex.placement.busy_per_stage()
    assert busy.tolist() == [(n + 2) * 8 // mesh[1]] * mesh[1]


def test_chunked_schedule_still_runs_and_costs_more(tmp_path):
    stack = mlp(5, 6, 8, 3)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(1)
    micro = {"x": rng.standard_normal((4, 2, 5), dtype=np.float32),
             "y": rng.integers(0, 3, (4, 2), dtype=np.int32)}
    cfg = StreamConfig(compute_dtype="float32", prefetch=1)
    est = jg.hybrid(num_exact=2, num_tangents=2)
    store = LayerStore.create(tmp_path / "s", params, optimizer=optax.sgd(0.1))
    out = {}
    for schedule in ("circular", "chunked"):
        ex = ComposedExecutor(stack, est, optax.sgd(0.1), store, cfg, mesh=make_mesh(1, 4),
                              schedule=schedule)
        out[schedule] = (ex.estimate(micro, jax.random.key(5))[1], ex.ticks)
    assert max_rel_err(out["circular"][0], out["chunked"][0]) <= 1e-5
    assert out["chunked"][1] == chunk_cost("hybrid_replace", layers=8, stages=4, micro_batches=4,
                                           selected=2, schedule="chunked").ticks
    assert out["circular"][1] < out["chunked"][1]
    with pytest.raises(ValueError, match="prefetch must be >= 1, got 0"):
        ComposedExecutor(stack, est, optax.sgd(0.1), store, StreamConfig(prefetch=0),
                         mesh=make_mesh(1, 4))
    with pytest.raises(ValueError, match="schedule must be one of"):
        ComposedExecutor(stack, est, optax.sgd(0.1), store, cfg, mesh=make_mesh(1, 4),
                         schedule="looped")
