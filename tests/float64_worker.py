"""Runs every in-memory engine in float64 (``jax_enable_x64``, float64 parameters and data) and
prints, as JSON, each engine's largest relative error against a float64 reference: for backprop
the gradient of a loss written here (the stack's forward, a float64 log-softmax of our own), for
the estimators the in-memory estimator for the same key, for every hybrid correction with
every micro-batch exact (N = 3, 5, 8; argument ``all_exact``, optionally the Ns) backprop.
Run by tests/test_float64.py in processes of its own (the x64 flag is global)."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's default compile options, as a user's process has them (the suite compiles with most
# optimisations off, tests/conftest.py): at LLVM's level 0 two programs computing the same
# float64 loss can differ in its last digits (SPSA's differences then by 1e-7, measured).
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jaxstream.grad as jg
from jaxstream.comm import data_parallel
from jaxstream.models import mlp
from jaxstream.pipeline import complete, gpipe_backprop, gpipe_forward
from jaxstream.pipeline.executor import pipeline

M, N = 4, 4


def rel(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / np.max(np.abs(np.asarray(y))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def f64(tree) -> bool:
    return all(a.dtype == jnp.float64 for a in jax.tree.leaves(tree))


def main(part: str) -> dict:
    """``part``: "memory" (backprop in memory and data-parallel against the float64 reference,
    data-parallel forward against the in-memory forward) or "pipeline" (the pipeline's backprop
    against the reference, its hybrid against the in-memory hybrid, its forward gradient
    float64); the test runs each in a process of its own (side by side under xdist)."""
    stack = mlp(5, 6, M, 3)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), stack.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, 2, 5))
    y = rng.integers(0, 3, (N, 2)).astype(np.int32)
    micro = {"x": jnp.asarray(x), "y": jnp.asarray(y)}
    flat = {"x": jnp.asarray(x.reshape(-1, 5)), "y": jnp.asarray(y.reshape(-1))}

    def own_loss(p):  # the model's forward; the loss in float64, written here
        h = stack.embed(p["embed"], flat["x"])
        for layer in range(M):
            h = stack.block(jax.tree.map(lambda a, i=layer: a[i], p["blocks"]), h)
        logits = stack.head(p["head"], h)
        logp = logits - jax.scipy.special.logsumexp(logits, axis=-1, keepdims=True)
        return -jnp.mean(logp[jnp.arange(len(flat["y"])), flat["y"]])

    ref = jax.grad(own_loss)(params)
    key = jax.random.key(3)
    out = {"reference_is_float64": f64(ref)}
    if part == "pipeline":
        return pipelines(stack, params, micro, ref, key, out)
    _, g = jax.jit(lambda p: jg.backprop()(stack, p, flat))(params)
    out["in_memory_backprop"] = (rel(g, ref), f64(g))
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    _, g = jax.jit(data_parallel(jg.backprop(), mesh), static_argnums=0)(stack, params, flat, key)
    out["dataparallel_backprop"] = (rel(g, ref), f64(g))
    fwd = jg.forward(2, "gaussian")
    _, g_mem = jax.jit(lambda p: fwd(stack, p, flat, key))(params)
    _, g = jax.jit(data_parallel(fwd, mesh, tangents="shared"), static_argnums=0)(
        stack, params, flat, key)
    out["dataparallel_forward"] = (rel(g, g_mem), f64(g))
    return out


def pipelines(stack, params, micro, ref, key, out: dict) -> dict:
    """The pipeline's backprop against the reference, its hybrid against the in-memory hybrid
    for the same key; its forward gradient is float64."""
    _, g, _ = jax.jit(pipeline(stack, gpipe_backprop(M, N), jg.backprop()))(params, micro, key)
    out["pipeline_backprop"] = (rel(g, ref), f64(g))
    hyb = jg.hybrid(exact_indices=(0, 1), num_tangents=2)
    _, g_mem = jax.jit(lambda p: hyb(stack, p, micro, key))(params)
    _, g, _ = jax.jit(pipeline(stack, complete(M, N, (0, 1)), hyb))(params, micro, key)
    out["pipeline_hybrid_cv"] = (rel(g, g_mem), f64(g))
    _, g, _ = jax.jit(pipeline(stack, gpipe_forward(M, N), num_tangents=2,
                               distribution="gaussian", correction="none"))(params, micro, key)
    out["pipeline_forward_is_float64"] = f64(g)
    return out


def problem(stack, n: int) -> tuple[dict, dict]:
    """(micro-batches (n, 2, 5), the same examples flat) in float64."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal((n, 2, 5))
    y = rng.integers(0, 3, (n, 2)).astype(np.int32)
    return ({"x": jnp.asarray(x), "y": jnp.asarray(y)},
            {"x": jnp.asarray(x.reshape(-1, 5)), "y": jnp.asarray(y.reshape(-1))})


def all_exact(ns: tuple[int, ...] = (3, 5, 8), stack=None, params=None) -> dict:
    """Every hybrid correction with every micro-batch exact equals backprop (the exact mean)
    at each N of ``ns``: weights such as 1/3 are formed in the parameters' dtype (in float32
    they were 3e-8 off unless N is a power of two); the pipeline's too (N = 3). The default Ns
    take each path of the hybrid's forward chunks (of 4): one partial chunk (3), a full and a
    partial one (5), two full ones (8, a power of two). The default model has 2 blocks (each
    N compiles a program of the four corrections; the depth changes none of the weights)."""
    if stack is None:
        stack = mlp(5, 6, 2, 3)
        params = jax.tree.map(lambda a: a.astype(jnp.float64), stack.init(jax.random.key(0)))
    out = {"reference_is_float64": True}
    corrections = ("replace", "control_variate", "weighted", "stein")
    for n in ns:
        micro, flat = problem(stack, n)
        _, ref = jax.jit(lambda p, b=flat: jg.backprop()(stack, p, b))(params)
        out["reference_is_float64"] &= f64(ref)
        ests = [jg.hybrid(exact_indices=tuple(range(n)), correction=c, num_tangents=2)
                for c in corrections]
        # one program for the four corrections (one compile)
        grads = jax.jit(lambda p, es=ests, b=micro: [e(stack, p, b, jax.random.key(1))[1]
                                                     for e in es])(params)
        for corr, g in zip(corrections, grads):
            out[f"all_exact_N{n}_{corr}"] = (rel(g, ref), f64(g))
        if n == 3:
            schedule = complete(stack.num_layers, n, tuple(range(n)))
            _, g, _ = jax.jit(pipeline(stack, schedule, ests[2]))(
                params, micro, jax.random.key(1))
            out[f"all_exact_N{n}_pipeline_weighted"] = (rel(g, ref), f64(g))
    return out


if __name__ == "__main__":
    # python float64_worker.py memory|pipeline  |  python float64_worker.py all_exact [N ...]
    if sys.argv[1] == "all_exact":
        print(json.dumps(all_exact(tuple(int(n) for n in sys.argv[2:]) or (3, 5, 8))))
    else:
        print(json.dumps(main(sys.argv[1])))
    sys.exit(0)
