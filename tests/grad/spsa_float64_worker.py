"""SPSA in float64 (``jax_enable_x64``), against references written here: prints, as JSON, the
figures tests/grad/test_spsa.py checks. Run in a process of its own (the x64 flag is global).

* ``bias``: for the same K directions (the key schedule's: direction k is the tangent of
  ``fold_in(key, k)``), the estimate minus the forward gradient (1/K) Σ (∇L·v_k) v_k (∇L by
  ``jax.grad``, the sum in NumPy), at ε and ε/2: its size relative to the forward gradient, the
  ratio of the two (4 for a bias of order ε²), and its distance to the third-derivative term
  (ε²/6) (1/K) Σ ∇³L[v_k, v_k, v_k] v_k (∇³L by three nested jvps);
* ``quadratic``: a quadratic loss (the central difference is then exact) through the generic
  path, low-rank directions on its matrix: the estimate against (1/K) Σ (∇L·v_k) v_k;
* ``mean``: R keys' estimates at ε = 1e-3, each coordinate's mean against ``jax.grad`` in units
  of its standard error;
* argument ``dataparallel``: data parallelism with shared directions against the in-memory
  estimate at ε = 1e-3 (tests/grad/test_new_estimators_engines.py).
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# XLA's default compile options, as a user's process has them (the suite compiles with most
# optimisations off, tests/conftest.py): at LLVM's level 0 two programs computing the same
# float64 loss can differ in its last digits (SPSA's differences then by 1e-7, measured).
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np

import jaxstream.grad as jg
from jaxstream.grad.tangents import TangentSpec, tangents
from jaxstream.models import mlp

EPS = (1e-2, 5e-3)
K = 4
R = 3000


def flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def f64(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)


def problem():
    stack = mlp(in_dim=5, width=4, depth=3, num_classes=3)
    params = f64(stack.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.standard_normal((16, 5))),
             "y": jnp.asarray(rng.integers(0, 3, 16), jnp.int32)}
    return stack, params, batch


def direction_trees(spec: TangentSpec, key, params, num: int) -> list:
    """Direction k of a step keyed ``key`` (the key schedule's tangent of ``fold_in(key, k)``),
    as a tree shaped like ``params``, for k < num (one compiled program)."""
    keys = jax.vmap(lambda k: jax.random.fold_in(key, k))(jnp.arange(num))
    vs = jax.jit(lambda ks: jax.lax.map(lambda k: tangents(spec, k, params), ks))(keys)
    return [jax.tree.map(lambda a, k=k: a[k, 0], vs) for k in range(num)]


def directions(spec: TangentSpec, key, params, num: int) -> list[np.ndarray]:
    return [flat(v) for v in direction_trees(spec, key, params, num)]


def third(loss, params, v_trees) -> np.ndarray:
    """d³/dt³ L(θ + t v) at t = 0 for each direction tree, by three nested jvps (float64, one
    compiled program)."""
    def one(v_tree):
        f = lambda t: loss(jax.tree.map(lambda p, v: p + t * v, params, v_tree))
        d1 = lambda t: jax.jvp(f, (t,), (1.0,))[1]
        d2 = lambda t: jax.jvp(d1, (t,), (1.0,))[1]
        return jax.jvp(d2, (0.0,), (1.0,))[1]

    stacked = jax.tree.map(lambda *a: jnp.stack(a), *v_trees)
    return np.asarray(jax.jit(lambda vs: jax.lax.map(one, vs))(stacked))


def bias(distribution: str) -> dict:
    stack, params, batch = problem()
    key = jax.random.key(5)
    g = flat(jax.jit(jax.grad(stack))(params, batch))
    spec = TangentSpec(1, distribution)
    vs = directions(spec, key, params, K)
    fg = sum(np.dot(g, v) * v for v in vs) / K
    loss = lambda p: stack(p, batch)
    v_trees = direction_trees(spec, key, params, K)
    pred = sum(t / 6.0 * v for t, v in zip(third(loss, params, v_trees), vs)) / K
    out = {"float64": True}
    norms = []
    run = jax.jit(lambda p, e: jg.spsa(K, e, distribution)(stack, p, batch, key),
                  static_argnums=1)
    for eps in EPS:
        _, est = run(params, eps)
        out["float64"] &= all(a.dtype == jnp.float64 for a in jax.tree.leaves(est))
        b = flat(est) - fg
        norms.append(np.linalg.norm(b))
        out[f"rel_{eps:g}"] = float(np.linalg.norm(b) / np.linalg.norm(fg))
        out[f"pred_err_{eps:g}"] = float(np.linalg.norm(b / eps**2 - pred) / np.linalg.norm(pred))
    out["ratio"] = float(norms[0] / norms[1])
    return out


def quadratic() -> float:
    """A quadratic loss (exact central differences) with low-rank directions on the matrix."""
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((3, 4))),
              "b": jnp.asarray(rng.standard_normal(4))}
    n = 16
    a = rng.standard_normal((n, n))
    a = jnp.asarray(a @ a.T / n)
    c = jnp.asarray(rng.standard_normal(n))

    def loss(p, batch):
        x = jnp.concatenate([p["w"].ravel(), p["b"]]) * batch
        return 0.5 * x @ a @ x + c @ x

    batch = jnp.ones(n)
    key = jax.random.key(9)
    est = jg.spsa(3, 1e-2, "gaussian", rank=2)
    _, got = jax.jit(lambda p: est(loss, p, batch, key))(params)
    g = flat(jax.jit(jax.grad(loss))(params, batch))
    vs = directions(TangentSpec(1, "gaussian", rank=2), key, params, 3)
    want = sum(np.dot(g, v) * v for v in vs) / 3
    return float(np.max(np.abs(flat(got) - want)) / np.max(np.abs(want)))


def mean() -> dict:
    stack, params, batch = problem()
    est = jg.spsa(1, 1e-3, "rademacher")
    keys = jax.random.split(jax.random.key(11), R)
    one = lambda k: jnp.concatenate([jnp.ravel(x) for x in
                                     jax.tree.leaves(est(stack, params, batch, k)[1])])
    samples = np.asarray(jax.jit(lambda ks: jax.lax.map(one, ks))(keys), np.float64)
    exact = flat(jax.jit(jax.grad(stack))(params, batch))
    z = (samples.mean(0) - exact) / (samples.std(0, ddof=1) / np.sqrt(R))
    return {"max_z": float(np.max(np.abs(z))), "mean_z2": float(np.mean(z**2)),
            "coordinates": int(z.size), "keys": R}


def dataparallel() -> dict:
    from jax.sharding import Mesh

    from jaxstream.comm import data_parallel

    stack, params, batch = problem()
    est = jg.spsa(3, 1e-3, "gaussian", rank=2)
    key = jax.random.key(2)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    _, ref = jax.jit(lambda p: est(stack, p, batch, key))(params)
    _, got = jax.jit(lambda p: data_parallel(est, mesh, tangents="shared")(stack, p, batch, key))(
        params)
    err = np.max(np.abs(flat(got) - flat(ref))) / np.max(np.abs(flat(ref)))
    return {"rel_err": float(err), "devices": len(jax.devices()),
            "float64": all(a.dtype == jnp.float64 for a in jax.tree.leaves(got))}


if __name__ == "__main__":
    if sys.argv[1:] == ["dataparallel"]:
        print(json.dumps(dataparallel()))
    else:
        print(json.dumps({"bias": bias("gaussian"), "quadratic": quadratic(), "mean": mean()}))
    sys.exit(0)
