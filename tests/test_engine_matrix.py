"""The engine x estimator matrix (docs/engines.md) as one test per pair.

Every engine's gradient equals the in-memory estimator (``jaxstream.grad``) configured the same
way for the same keys, to a max relative error of 1e-5 (fp32; max over leaves of
‖a − b‖∞ / ‖b‖∞). The references are written here from the public estimators alone, with the
variants docs/engines.md states:

* pipeline forward estimates draw tangents per micro-batch: the reference is the estimator on
  micro-batch n with key ``fold_in(key, n)``, averaged over n;
* pipeline selections are static: the hybrids use ``exact_indices``; nested groups (a
  ``truncated`` table) become ``exact_from``, read off the table's W / BW / FBW cells here;
* pipeline ``guess`` differentiates along a direction from the step before (an exact-subset
  mean at other params and another batch), given to the reference as ``guess=``;
* data-parallel activity perturbation (shared tangents) draws each activation tangent for the
  whole batch and keeps the shard's rows: its reference is the estimator itself (a draw per
  shard, the estimator on each shard averaged, is far from it: checked below).

The composed engine (streamed stages over a ``data × stage`` mesh) is a column like the others
and needs no variant. A combine rule registered only here (``halfway``) is a row: a new rule
runs on every engine once it is registered in ``jaxstream.grad.combine``.

The rows are ``benchmarks/engine_cases.py``'s, the table ``benchmarks/engines.py`` prints; a
row an engine refuses is a test that the refusal says what its case names. The in-memory
column of the matrix is the reference itself, so it has no test here. Sizes:
an MLP of depth 4 (one block per stage), 4 micro-batches of 4 examples, 4 devices (from the
8 simulated CPU devices of tests/conftest.py). Each reference compiles once and serves every
engine; each engine compiles once per estimator.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxstream.grad as jg
from jaxstream.comm import data_parallel
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.grad import combine
from jaxstream.pipeline import complete, gpipe_backprop, gpipe_forward, truncated
from jaxstream.pipeline.executor import pipeline
from jaxstream.pipeline.table import GRAD_OPS
from jaxstream.quality import gradient_error
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from tests.trees import max_rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_cases  # the rows, shared with benchmarks/engines.py
from engine_cases import ENGINES, SEL, B, K, M, N

TOL = 1e-5
SGD = optax.sgd(0.1)
NESTED = truncated(M, N, SEL)


def table_exact_from(sched, num_layers: int) -> tuple[int, ...]:
    """``exact_from`` of the groups ``sched`` produces, read off its cells: micro-batch j's first
    exact block is the first layer of the lowest stage with a weight-gradient op for j."""
    per = num_layers // sched.num_stages
    out = []
    for j in range(sched.micro_batches):
        cells = np.isin(sched.kind, GRAD_OPS) & (sched.micro == j) & ~sched.stale
        stages = np.nonzero(cells.any(axis=0))[0]
        out.append(int(stages.min()) * per if stages.size else num_layers + 1)
    return tuple(out)


def _halfway(stats, totals):
    """A combine rule the library does not have: halfway between the exact-subset mean h and
    the control variate, h + ½ · (tangent estimate of the residual). Registered here, in one
    place; every engine must run it."""
    cv = combine.CONTROL_VARIATE.estimate(stats, totals)
    return jax.tree.map(lambda g, h: h + 0.5 * (g - h), cv, stats.h)


HALFWAY = combine.register(combine.Rule("halfway", _halfway, combine.CONTROL_VARIATE.partials,
                                        cross=True, stale_ok=True, doc="test rule"))

# the shared rows (benchmarks/engine_cases.py), and a rule registered only here
CASES = {**engine_cases.cases(table_exact_from(NESTED, M)),
         "hyb-new-rule": engine_cases.Case(
             jg.hybrid(exact_indices=SEL, correction="halfway", num_tangents=K), "micro")}
ESTIMATORS = {name: (c.estimator, c.layout) for name, c in CASES.items()}
MODELS = engine_cases.models()
STACK = MODELS[""]
COMPOSED_MESH = (2, 2)  # data × stage: 2 replicas beside 2 stages of 2 streamed layers each
PAIRS = [(engine, name) for name in CASES for engine in ENGINES
         if engine not in dict(CASES[name].refused)]
REFUSALS = [(engine, name, pattern) for name in CASES for engine, pattern in CASES[name].refused]


def stack_of(name: str):
    """The model of row ``name``: with its own local heads for the "-own" rows, grouped ones
    for the "-grouped" row, Ren et al.'s aggregated cells for the "-aggregated" row."""
    return MODELS[engine_cases.suffix(name)]


def _data(seed: int):
    """(micro-batched, flat) NumPy batch: leaves (N, B, ...) and (N * B, ...)."""
    rng = np.random.default_rng(seed)
    micro = {"x": rng.standard_normal((N, B, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (N, B), dtype=np.int32)}
    return micro, jax.tree.map(lambda a: a.reshape(N * B, *a.shape[2:]), micro)


@pytest.fixture(scope="module")
def problem():
    """(params by model, micro-batched batch, flat batch, key)."""
    params = {m: m.init(jax.random.key(0)) for m in MODELS.values()}
    micro, flat = _data(0)
    return params, micro, flat, jax.random.key(7)


@pytest.fixture(scope="module")
def guess_direction():
    """A direction from the step before: the exact mean of the selected micro-batches at other
    params, on another batch (what a pipeline's ``guess`` keeps in its state)."""
    params = STACK.init(jax.random.key(1))
    micro, _ = _data(1)
    grad = jax.jit(jax.grad(STACK))
    gs = [grad(params, jax.tree.map(lambda a, i=i: a[i], micro)) for i in SEL]
    return jax.tree.map(lambda *g: sum(g) / len(g), *gs)


@pytest.fixture(scope="module")
def store(tmp_path_factory, problem):
    """One layer store of the initial params per model; ``estimate`` reads it and commits
    nothing."""
    root = tmp_path_factory.mktemp("matrix")
    return {m: LayerStore.create(root / f"store{i}", p, optimizer=SGD)
            for i, (m, p) in enumerate(problem[0].items())}


# ------------------------------------------------------------------ compiling
class Compiled:
    """``fn`` jitted and compiled, once, for the arguments of its first call."""

    def __init__(self, fn):
        self.fn, self.exe = fn, None

    def __call__(self, *args):
        if self.exe is None:
            self.exe = jax.jit(self.fn).lower(*args).compile()
        return self.exe(*args)


# ------------------------------------------------------------------ references (in memory)
@functools.cache
def reference(name: str, variant: str) -> Compiled:
    """The in-memory estimator ``name``: ``(params, batch, key[, direction]) -> (loss, grads)``.

    variant "same": the estimator on the batch; "guess": with ``guess=direction``;
    "per-micro": on micro-batch n keyed ``fold_in(key, n)``, averaged; "per-shard": on each of
    M shards of the flat batch with ``key``, averaged.
    """
    est, _ = ESTIMATORS[name]
    stack = stack_of(name)
    if variant == "same":
        return Compiled(lambda p, b, k: est(stack, p, b, k))
    if variant == "guess":
        return Compiled(lambda p, b, k, u: est(stack, p, b, k, guess=u))
    if variant == "per-micro":
        def per_micro(p, micro, key):
            keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(jnp.arange(N))
            losses, grads = jax.vmap(lambda b, k: est(stack, p, b, k))(micro, keys)
            return losses.mean(), jax.tree.map(lambda g: g.mean(0), grads)
        return Compiled(per_micro)
    if variant == "per-shard":
        def per_shard(p, flat, key):
            shards = jax.tree.map(lambda a: a.reshape(M, -1, *a.shape[1:]), flat)
            losses, grads = jax.vmap(lambda b: est(stack, p, b, key))(shards)
            return losses.mean(), jax.tree.map(lambda g: g.mean(0), grads)
        return Compiled(per_shard)
    raise ValueError(f"variant: {variant!r}")


def expected(engine: str, name: str, problem, direction):
    """The in-memory (loss, grads) the engine must reproduce, and the variant's name."""
    by_model, micro, flat, key = problem
    params = by_model[stack_of(name)]
    est, layout = ESTIMATORS[name]
    data = flat if layout == "flat" else micro
    if engine == "pipeline" and isinstance(est, (jg.Forward, jg.LocalForwardWeights)):
        return reference(name, "per-micro")(params, micro, key), "per-micro"
    if engine == "pipeline" and name == "hyb-guess":
        return reference(name, "guess")(params, micro, key, direction), "guess"
    return reference(name, "same")(params, data, key), "same"


# ------------------------------------------------------------------ engines
@functools.cache
def pipeline_for(name: str):
    """The pipeline of estimator ``name``: forward-only table for forward estimators, GPipe
    backprop for backprop, ``complete`` (``truncated`` for nested groups) for hybrids."""
    est, _ = ESTIMATORS[name]
    if isinstance(est, jg.Backprop):
        sched = gpipe_backprop(M, N)
    elif isinstance(est, jg.ExactSubset):  # GPipe backprop over the selected micro-batches
        sched = gpipe_backprop(M, est.num_exact)
    elif isinstance(est, (jg.Forward, jg.LocalForwardWeights, jg.LocalGuess)):
        sched = gpipe_forward(M, N)
    else:
        sched = NESTED if est.exact_from is not None else complete(M, N, SEL)
    return pipeline(stack_of(name), sched, est)


@functools.cache
def data_parallel_for(name: str):
    est, layout = ESTIMATORS[name]
    mesh = Mesh(np.array(jax.devices()[:M]), ("data",))
    dp = data_parallel(est, mesh, tangents="shared", batch_axis=0 if layout == "flat" else 1)
    stack = stack_of(name)
    return Compiled(lambda p, b, k: dp(stack, p, b, k))


def run_engine(engine: str, name: str, problem, direction, store, key=None):
    """(loss, grads) of ``engine`` for estimator ``name`` (``key`` overrides the problem's)."""
    by_model, micro, flat, key0 = problem
    stack = stack_of(name)
    params, store = by_model[stack], store[stack]
    key = key0 if key is None else key
    est, layout = ESTIMATORS[name]
    if engine == "dataparallel":
        return data_parallel_for(name)(params, flat if layout == "flat" else micro, key)
    if engine == "pipeline":
        kw = {"guess": direction} if name == "hyb-guess" else {}
        return pipeline_for(name)(params, micro, key, **kw)[:2]
    cfg = StreamConfig(compute_dtype="float32", prefetch=2)
    if engine == "composed":
        ex = ComposedExecutor(stack, est, SGD, store, cfg, mesh=make_mesh(*COMPOSED_MESH))
    else:
        ex = StreamedExecutor(stack, est, SGD, store, cfg)
    try:
        return ex.estimate(micro, key)
    finally:
        ex.close()  # its host worker's thread ends here, not when the executor is collected


@pytest.mark.parametrize("engine,name", PAIRS, ids=[f"{e}-{n}" for e, n in PAIRS])
def test_engine_equals_in_memory_estimator(engine, name, problem, guess_direction, store):
    loss, grads = run_engine(engine, name, problem, guess_direction, store)
    (ref_loss, ref), variant = expected(engine, name, problem, guess_direction)
    e = gradient_error(grads, ref)
    print(f"{engine} {name} ({variant}): whole {e.whole:.2e}, worst leaf {e.leaf:.2e} {e.worst}")
    assert e.max <= TOL, f"{engine} x {name} ({variant}): {e} > {TOL:g}"
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))


@pytest.mark.parametrize("engine,name,pattern", REFUSALS,
                         ids=[f"{e}-{n}" for e, n, _ in REFUSALS])
def test_an_engine_refuses_what_it_cannot_carry_by_name(engine, name, pattern, problem,
                                                         guess_direction, store):
    """A pair the matrix marks refused is refused before any compute, with an error that
    names what the engine cannot carry — never run approximately."""
    with pytest.raises((ValueError, TypeError), match=pattern):
        run_engine(engine, name, problem, guess_direction, store)


@pytest.mark.parametrize("engine,name", [("pipeline", "fwd-w-gauss"), ("stream", "hyb-cv"),
                                         ("dataparallel", "fwd-act"),
                                         ("composed", "hyb-weighted")])
def test_a_wrong_engine_fails_the_comparison(engine, name, problem, guess_direction, store):
    """The comparison can fail: the engine run with another key, or compared with the
    reference of another variant, is far off."""
    (_, ref), _ = expected(engine, name, problem, guess_direction)
    _, other_key = run_engine(engine, name, problem, guess_direction, store,
                              key=jax.random.key(8))
    assert max_rel_err(other_key, ref) > 1e-3
    params, _, flat, key = problem[0][STACK], *problem[1:]
    if engine == "pipeline":  # a stated variant matters: the whole-batch reference is not it
        _, grads = run_engine(engine, name, problem, guess_direction, store)
        _, plain = reference(name, "same")(params, flat, key)
        assert max_rel_err(grads, plain) > 1e-3
    if engine == "dataparallel":  # the replicas' rows of one draw, not a draw per shard
        _, grads = run_engine(engine, name, problem, guess_direction, store)
        _, per_shard = reference(name, "per-shard")(params, flat, key)
        assert max_rel_err(grads, per_shard) > 1e-3


def test_nested_groups_are_partial():
    """hyb-cv-nested is not a plain selection: the truncated table gives the selected
    micro-batches exact gradients for the top stages only, and the others none."""
    groups = table_exact_from(NESTED, M)
    assert all(0 < groups[j] <= M for j in SEL), groups
    assert all(groups[j] == M + 1 for j in range(N) if j not in SEL), groups


def test_the_new_rule_is_what_it_says(problem):
    """The registered rule's in-memory estimate is ½ (control variate + exact-subset mean),
    the mean written here from ``jax.grad`` alone: the rule is not a copy of another."""
    params, micro, _, key = problem[0][STACK], *problem[1:]
    _, half = reference("hyb-new-rule", "same")(params, micro, key)
    _, cv = reference("hyb-cv", "same")(params, micro, key)
    grad = jax.jit(jax.grad(STACK))
    gs = [grad(params, jax.tree.map(lambda a, i=i: a[i], micro)) for i in SEL]
    h = jax.tree.map(lambda *g: sum(g) / len(g), *gs)
    want = jax.tree.map(lambda c, hh: 0.5 * (c + hh), cv, h)
    assert max_rel_err(half, want) <= TOL
    assert max_rel_err(half, cv) > 1e-3 and max_rel_err(half, h) > 1e-3
