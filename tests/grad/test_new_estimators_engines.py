"""The zeroth-order estimator (``spsa``) and low-rank tangents (``forward(rank=r)``) on every
engine: each engine either equals the in-memory estimator for the same key (the references of
tests/test_engine_matrix.py: the estimator on the whole batch, or per micro-batch keyed
``fold_in(key, n)`` and averaged for a pipeline's forward estimate) to 1e-5, or refuses the
estimator by its name when it is built, before any batch is given to it.

* low-rank tangents are a :class:`~jaxstream.grad.TangentSpec` field, drawn wherever an engine
  draws tangents: every engine runs them;
* ``spsa`` is a ``zeroth_order`` forward pass: the in-memory step and data parallelism run it
  (each replica the estimator on its shard with the shared key: the same directions, and the
  mean of the shards' loss differences is the batch's); the pipeline, the streamed and the
  composed engines run jvp sweeps only and refuse it by name.

In float32 a central difference of two losses carries rounding of order ε₃₂ L / ε, different
in every engine's order of summation; the SPSA rows here use ε = 0.1 (about 1e-6 of the
gradient), and tests/grad/spsa_float64_worker.py checks data parallelism at ε = 1e-3 in
float64.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxstream
import jaxstream.grad as jg
from jaxstream.comm import data_parallel
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.models import mlp
from jaxstream.pipeline import gpipe_forward
from jaxstream.pipeline.executor import pipeline
from jaxstream.quality import gradient_error
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

ROOT = Path(__file__).resolve().parents[2]
M, N, B = 4, 4, 4  # stages / devices, micro-batches, examples per micro-batch
TOL = 1e-5
STACK = mlp(in_dim=6, width=8, depth=M, num_classes=3)
SGD = optax.sgd(0.1)
ESTIMATORS = {
    "spsa": jg.spsa(2, 0.1, "gaussian"),
    "spsa-rank": jg.spsa(2, 0.1, "rademacher", rank=2),
    "fwd-rank": jg.forward(2, "gaussian", rank=2),
}
ENGINES = ("dataparallel", "pipeline", "stream", "composed")
# (engine, estimator) -> what the refusal says: the estimator's name and the pass it needs
REFUSED = {(e, n): (f"{e}: "
                    f"{re.escape(ESTIMATORS[n].plan.describe())} needs a 'zeroth_order' "
                    "forward pass")
           for e in ("pipeline", "stream", "composed") for n in ("spsa", "spsa-rank")}
PAIRS = [(e, n) for n in ESTIMATORS for e in ENGINES]


@pytest.fixture(scope="module")
def problem():
    params = STACK.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((N, B, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (N, B), dtype=np.int32)}
    flat = jax.tree.map(lambda a: a.reshape(N * B, *a.shape[2:]), micro)
    return params, micro, flat, jax.random.key(7)


@pytest.fixture(scope="module")
def store(tmp_path_factory, problem):
    return LayerStore.create(tmp_path_factory.mktemp("new_estimators") / "store", problem[0],
                             optimizer=SGD)


@functools.cache
def reference(name: str, per_micro: bool):
    """The in-memory estimator: on the whole batch, or per micro-batch (key fold_in(key, n))
    averaged."""
    est = ESTIMATORS[name]
    if not per_micro:
        return jax.jit(lambda p, b, k: est(STACK, p, b, k))

    def averaged(p, micro, key):
        keys = jax.vmap(lambda n: jax.random.fold_in(key, n))(jnp.arange(N))
        losses, grads = jax.vmap(lambda b, k: est(STACK, p, b, k))(micro, keys)
        return losses.mean(), jax.tree.map(lambda g: g.mean(0), grads)

    return jax.jit(averaged)


def build(engine: str, name: str, store):
    """The engine for estimator ``name`` (no batch yet: a refusal comes from here)."""
    est = ESTIMATORS[name]
    if engine == "dataparallel":
        mesh = Mesh(np.array(jax.devices()[:M]), ("data",))
        return data_parallel(est, mesh, tangents="shared")
    if engine == "pipeline":
        return pipeline(STACK, gpipe_forward(M, N), est)
    cfg = StreamConfig(compute_dtype="float32", prefetch=2)
    if engine == "composed":
        return ComposedExecutor(STACK, est, SGD, store, cfg, mesh=make_mesh(2, 2))
    return StreamedExecutor(STACK, est, SGD, store, cfg)


def run(engine: str, eng, problem):
    params, micro, flat, key = problem
    if engine == "dataparallel":
        return jax.jit(lambda p, b, k: eng(STACK, p, b, k))(params, flat, key)
    if engine == "pipeline":
        return eng(params, micro, key)[:2]
    return eng.estimate(micro, key)


@pytest.mark.parametrize("engine,name", PAIRS, ids=[f"{e}-{n}" for e, n in PAIRS])
def test_engine_equals_in_memory_or_refuses_by_name(engine, name, problem, store):
    if (engine, name) in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[engine, name]) as err:
            build(engine, name, store)
        print(f"{engine} x {name}: refused: {err.value}")
        assert "\n" not in str(err.value)
        return
    loss, grads = run(engine, build(engine, name, store), problem)
    params, micro, flat, key = problem
    per_micro = engine == "pipeline"
    ref_loss, ref = reference(name, per_micro)(params, micro if per_micro else flat, key)
    e = gradient_error(grads, ref)
    print(f"{engine} x {name}: whole {e.whole:.2e}, worst leaf {e.leaf:.2e} {e.worst}")
    assert e.max <= TOL, f"{engine} x {name}: {e}"
    assert abs(float(loss) - float(ref_loss)) <= TOL * abs(float(ref_loss))
    # the comparison can fail: another key's estimate is far from it
    _, other = reference(name, per_micro)(params, micro if per_micro else flat,
                                          jax.random.key(8))
    assert gradient_error(other, ref).max > 1e-2


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_train_step_applies_the_estimate(name, problem):
    """``jaxstream.train_step`` (the in-memory engine) with SGD: params − lr · the estimator's
    gradient for the step's key."""
    params, _, flat, key = problem
    est = ESTIMATORS[name]
    step = jaxstream.train_step(est, SGD, STACK)
    new, _, loss = step(params, step.init(params), flat, key)
    ref_loss, g = reference(name, False)(params, flat, key)
    want = jax.tree.map(lambda p, gg: p - 0.1 * gg, params, g)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


def test_scalar_exchange_refuses_spsa_by_name():
    """Data parallelism's scalar exchange regenerates jvp tangents: it names what it got."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ValueError, match=r"exchange: 'scalars' needs a weight-perturbation "
                                         r"forward estimator .* got SPSA; use "
                                         r"exchange='gradients'"):
        data_parallel(jg.spsa(2), mesh, exchange="scalars")


@pytest.mark.slow
def test_data_parallel_spsa_equals_in_memory_in_float64():
    """Float64, ε = 1e-3 (no float32 rounding of the loss differences): data parallel with
    shared directions equals the in-memory estimate to 1e-10."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "grad" / "spsa_float64_worker.py"),
                          "dataparallel"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(res)
    assert res["float64"] and res["devices"] >= 2
    assert res["rel_err"] <= 1e-10, res
