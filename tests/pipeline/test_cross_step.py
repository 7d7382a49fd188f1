"""Cross-step chains: every stage gets the previous step's exact gradients (table and executor).

The table tests are NumPy only. The executor test runs two steps of a crossstep table with the
control variate on 4 simulated devices and checks step 1 against the in-memory reference: h from
step 0's selected micro-batches at step 0's params (every stage: one group), tangents of step 1.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad import corrections as cr
from jaxstream.grad.tangents import TangentSpec, micro_key
from jaxstream.pipeline import (
    complete,
    coverage_per_stage,
    crossstep,
    delayed,
    fill_ratio,
    forward_only_idle_mask,
    gpipe_backprop,
    groups_nested,
    lower,
    make_schedule,
    max_coverage,
    max_full_chains,
    min_added_ticks,
    one_f_one_b,
    staleness_per_stage,
    summary,
    truncated,
    validate,
)
from jaxstream.pipeline import groups as stage_groups
from jaxstream.pipeline.executor import pipeline
from jaxstream.pipeline.lowering import exact_from
from tests.pipeline.tiny import tiny_setup

K = 2  # tangents


@pytest.mark.parametrize("m", [2, 4, 6, 8])
@pytest.mark.parametrize("n", [2, 4, 16])
def test_one_full_chain_with_zero_added_ticks_at_even_m(m, n):
    s = crossstep(m, n, (n - 1,))
    validate(s)
    assert s.num_ticks == n + m - 1  # zero added ticks
    assert coverage_per_stage(s) == (1 / n,) * m
    assert staleness_per_stage(s) == (1,) * m
    assert stage_groups(s, stale=True) == ((n - 1,),) * m and s.stale[s.kind > 1].all()
    with pytest.raises(ValueError, match=r"selected=\(0, 1\).*at most 1 full chain"):
        crossstep(m, n, (0, 1))


def _full_paths(m, n, lead=0, trail=0):
    """Every full chain through the idle cells of forward-only GPipe shifted by `lead` idle
    ticks, with `trail` more at the end (exhaustive; the reference)."""
    idle = np.ones((n + m - 1 + lead + trail, m), bool)
    idle[lead : lead + n + m - 1] = forward_only_idle_mask(m, n)
    out = []

    def rec(st, t_prev, acc):
        if st < 0:
            out.append(tuple(acc))
            return
        for t in range(t_prev + 1, idle.shape[0]):
            if idle[t, st]:
                rec(st - 1, t, [*acc, t])

    rec(m - 1, -1, [])
    return out


@pytest.mark.parametrize("m", range(2, 9))
def test_max_full_chains_at_zero_ticks_equals_exhaustive_search(m):
    for n in (2, 5, 8):
        paths = _full_paths(m, n)
        assert len(paths) == (1 if m % 2 == 0 else 0)  # one path at most: no two disjoint
        assert max_full_chains(m, n, 0) == len(paths)


def _disjoint(paths, k, start=0, used=()):
    if k == 0:
        return True
    return any(all(a != b for q in used for a, b in zip(paths[i], q))
               and _disjoint(paths, k - 1, i + 1, (*used, paths[i]))
               for i in range(start, len(paths)))


def test_min_added_ticks_equals_exhaustive_search():
    for m, n in [(2, 3), (3, 3), (4, 3), (5, 3), (6, 2)]:
        for k in range(1, n + 1):
            a = next(a for a in range(8) if any(
                _disjoint(_full_paths(m, n, lead, a - lead), k) for lead in range(a + 1)))
            assert min_added_ticks(m, n, k) == a, (m, n, k)


@pytest.mark.parametrize("m", [3, 5])
def test_odd_m_needs_an_added_tick(m):
    with pytest.raises(ValueError, match=f"num_stages={m} is odd"):
        crossstep(m, 8, (0,))
    s = crossstep(m, 8, (0,), added_ticks=1)
    validate(s)
    assert s.num_ticks == 8 + m and coverage_per_stage(s) == (1 / 8,) * m


@pytest.mark.parametrize("m,n", [(4, 4), (4, 8), (8, 16), (6, 5)])
def test_k_chains_cover_every_stage_with_the_fewest_ticks(m, n):
    for k in range(1, m // 2 + 1):
        a = min_added_ticks(m, n, k)
        sel = tuple(range(n - k, n))
        s = crossstep(m, n, sel, added_ticks=a)
        validate(s)
        lowered = lower(s)  # the executor's tables: one stale group per chain, every stage
        assert lowered.stale and lowered.prev_selected == sel and lowered.groups.all()
        assert s.num_ticks == n + m - 1 + a
        assert coverage_per_stage(s) == (k / n,) * m
        assert staleness_per_stage(s) == (1,) * m
        if a > 0:
            with pytest.raises(ValueError, match=f"added_ticks={a - 1}"):
                crossstep(m, n, sel, added_ticks=a - 1)
        assert max_full_chains(m, n, a) >= k
    # the counting bound: a chain descends one stage per tick (see cross_step.py)
    assert min_added_ticks(m, n, 1) == 0 and min_added_ticks(m, n, 2) == 2


def test_max_coverage_is_at_least_the_delayed_policy():
    for m, n, k in [(4, 8, 2), (8, 16, 4), (8, 8, 2)]:
        sel = tuple(range(k))
        for a in range(3):
            s = max_coverage(m, n, sel, added_ticks=a)
            validate(s)
            assert s.num_ticks == n + m - 1 + a
            g = stage_groups(s, stale=True)
            assert groups_nested(g)
            if a == 0:
                assert sum(map(len, g)) >= sum(map(len, stage_groups(delayed(m, n, sel), True)))
        if min_added_ticks(m, n, k) <= 2:
            assert coverage_per_stage(max_coverage(m, n, sel, 2)) >= (k / n,) * m


def test_metrics_of_every_policy():
    m, n = 4, 8
    for s in (gpipe_backprop(m, n), one_f_one_b(m, n), complete(m, n, tuple(range(n)))):
        assert coverage_per_stage(s) == (1.0,) * m and staleness_per_stage(s) == (0,) * m
    assert coverage_per_stage(truncated(m, n, (0,))) == (0.0, 0.0, 1 / n, 1 / n)
    assert staleness_per_stage(truncated(m, n, (0,))) == (None, None, 0, 0)
    assert staleness_per_stage(make_schedule("forward", m, n)) == (None,) * m
    r = summary(make_schedule("crossstep", m, n, (0,)))
    assert r["added_ticks"] == 0 and r["staleness_per_stage"] == [1] * m
    assert r["fill_ratio"] == pytest.approx(m / (m * (m - 1)))  # one cell per stage of M-1
    # a leading idle tick shifts the forward ops: the fill is measured against them
    s = max_coverage(m, n, (0, 1), added_ticks=1)
    assert 0 < fill_ratio(s) <= 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="added_ticks=-1"):
        crossstep(4, 8, (0,), added_ticks=-1)
    with pytest.raises(ValueError, match="selected micro-batch 9"):
        crossstep(4, 8, (9,))
    with pytest.raises(ValueError, match="k=9"):
        min_added_ticks(4, 8, 9)


_setup = tiny_setup


def _max_rel(a, b):
    fa = np.concatenate([np.ravel(x) for x in jax.tree.leaves(a)])
    fb = np.concatenate([np.ravel(x) for x in jax.tree.leaves(b)])
    return float(np.max(np.abs(fa - fb)) / np.max(np.abs(fb)))


def test_executor_runs_crossstep_chains_of_the_previous_step():
    m, n = 4, 6
    # four full chains need 4 added ticks, all before the forward ops: the table has leading
    # idle ticks, chains wholly in the warm-up and chains that finish in the drain
    sched = crossstep(m, n, (1, 3, 4, 5), added_ticks=min_added_ticks(m, n, 4))
    assert sched.kind[0, 0] == 0 and sched.num_ticks == n + m - 1 + 4
    stack, params0, batch0 = _setup(m, n, seed=0)
    _, params1, batch1 = _setup(m, n, seed=10)
    pipe = pipeline(stack, sched, num_tangents=K, correction="control_variate")
    carry = pipe.init_carry(params0, batch0)
    _, _, aux0 = pipe(params0, batch0, jax.random.key(1), carry)
    k1 = jax.random.key(2)
    _, g1, _ = pipe(params1, batch1, k1, aux0["carry"])
    spec = TangentSpec(K)
    sel = jnp.array(pipe.lowered.prev_selected)
    depth = jnp.array([exact_from(sched, stack.num_layers)[j] for j in pipe.lowered.selected])
    assert np.all(np.asarray(depth) == 0)  # every block of every stage

    @jax.jit
    def reference(params0, batch0, params1, batch1, k1):
        exact = jax.vmap(lambda b: jax.grad(stack)(params0, b))(
            jax.tree.map(lambda a: a[sel], batch0))
        h, _ = cr.group_mean(exact, cr.group_masks(params1, depth), params1)
        keys = jax.vmap(lambda i: micro_key(k1, i))(jnp.arange(n))
        _, d = jax.vmap(lambda b, k: jg.stack_directional(stack, spec, params1, b, k))(
            batch1, keys)
        return cr.control_variate(spec, keys, d, h, cr.residual_scalars(spec, keys, h), params1)

    err = _max_rel(g1, reference(params0, batch0, params1, batch1, k1))
    print(f"crossstep M={m} N={n} k=4 max_rel_err={err:.3e}")
    assert err <= 1e-5
    assert pipe._compiled["fn"]._cache_size() == 1
