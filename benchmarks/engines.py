"""Every engine against the in-memory estimator: the (engine, estimator) matrix.

    python benchmarks/engines.py --quick --json /tmp/engines.json

For each pair: the engine's gradient against the in-memory estimator configured the same way
for the same keys by :func:`jaxstream.quality.gradient_error` — ``whole_rel_err`` ‖a − b‖ / ‖b‖
and ``leaf_rel_err``, the worst leaf's ‖a_l − b_l‖ / max(‖b_l‖, 1e-3 ‖b‖); ``max_rel_err`` is
the larger (goal ≤ 1e-5) —
and ``cosine_to_exact``, the cosine of the engine's gradient to the exact gradient of the batch.
A pair an engine does not run is a row with ``status: "refused"`` and the engine's own error
message — the matrix shows what is missing instead of hiding it.

Engines: ``memory`` (the estimator itself), ``dataparallel`` (4 simulated devices, shared
tangents, gradients all-reduced), ``pipeline`` (4 stages; forward estimates use tangents per
micro-batch, hybrids a static selection, so the reference is the in-memory estimator with the
same per-micro-batch keys (ᵖ) and fixed ``exact_indices``; ``guess`` is given its direction
before the forward pass — in training the previous step's exact mean, here this step's, so that
it can be compared), ``stream`` (layers from a TensorStore), ``composed`` (layers from a
TensorStore through 2 pipeline stages beside 2 replicas: a 2 × 2 mesh). Data parallel activity
perturbation with shared tangents draws each activation tangent for the whole batch and keeps
the shard's rows, so its reference is the in-memory estimator itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from engine_cases import ENGINES, SEL, B, M, N, cases, models, suffix

from jaxstream.comm import data_parallel
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.experiment.docblock import machine, write_tables
from jaxstream.grad.tangents import micro_key
from jaxstream.pipeline import complete, gpipe_backprop, gpipe_forward, truncated
from jaxstream.pipeline.executor import pipeline
from jaxstream.pipeline.lowering import exact_from
from jaxstream.quality.metrics import gradient_error
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor


def estimators(num_layers: int) -> dict:
    """The estimators of the matrix (benchmarks/engine_cases.py): name -> (estimator, layout
    of its batch), the nested hybrid's groups from the library's ``exact_from``."""
    return {name: (c.estimator, c.layout)
            for name, c in cases(exact_from(truncated(M, N, SEL), num_layers)).items()}


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def cosine(a, b) -> float:
    fa, fb = _flat(a), _flat(b)
    return float(fa @ fb / (np.linalg.norm(fa) * np.linalg.norm(fb) + 1e-30))


def per_micro_forward(est, stack, params, micro, key):
    """The in-memory forward estimator with micro-batch n keyed ``micro_key(key, n)``,
    averaged over the N micro-batches (what a pipeline's forward-only table computes)."""
    n = jax.tree.leaves(micro)[0].shape[0]
    out = [est(stack, params, jax.tree.map(lambda a, i=i: a[i], micro), micro_key(key, i))
           for i in range(n)]
    return (jnp.mean(jnp.stack([o[0] for o in out])),
            jax.tree.map(lambda *g: sum(g) / n, *[o[1] for o in out]))


def run_pipeline(name, est, stack, params, micro, key):
    """(grads, own reference or None); raises ValueError/TypeError when the pipeline refuses.
    Forward estimators run on a forward-only table with tangents per micro-batch (reference:
    :func:`per_micro_forward`; the local guess's direction is the whole batch's, so its
    reference is the in-memory estimator's); hybrids on ``complete`` (``truncated`` for nested
    groups)."""
    plan = est.plan
    if plan.exact == "all":
        return pipeline(stack, gpipe_backprop(M, N), est)(params, micro, key)[1], None
    if plan.exact == "selected" and plan.forward == "none":  # GPipe backprop over the selection
        return pipeline(stack, gpipe_backprop(M, plan.num_exact), est)(params, micro, key)[1], None
    if plan.exact == "none":
        grads = pipeline(stack, gpipe_forward(M, N), est)(params, micro, key)[1]
        if plan.forward == "local_guess":  # one direction for the whole batch: the same
            return grads, None
        return grads, per_micro_forward(est, stack, params, micro, key)[1]
    sched = truncated(M, N, SEL) if plan.nested else complete(M, N, SEL)
    pipe = pipeline(stack, sched, est)
    if pipe.along:  # the direction comes from a step before: here this step's h
        direction = pipe(params, micro, key)[2]["direction"]
        return pipe(params, micro, key, guess=direction)[1], None
    return pipe(params, micro, key)[1], None


def run_stream(est, stack, params, micro, key, root):
    store = LayerStore.create(root, params, optimizer=optax.sgd(0.1))
    ex = StreamedExecutor(stack, est, optax.sgd(0.1), store,
                          StreamConfig(compute_dtype="float32", prefetch=2))
    return ex.estimate(micro, key)[1]


def run_composed(est, stack, params, micro, key, root):
    """The composed engine: streamed stages on a 2 × 2 data × stage mesh."""
    store = LayerStore.create(root, params, optimizer=optax.sgd(0.1))
    ex = ComposedExecutor(stack, est, optax.sgd(0.1), store,
                          StreamConfig(compute_dtype="float32", prefetch=1),
                          mesh=make_mesh(data=2, stage=2))
    return ex.estimate(micro, key)[1]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="(the matrix is small either way)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--doc", type=str, default=None,
                    help="rewrite this Markdown file's <!-- benchmark: engines.py matrix --> block")
    args = ap.parse_args(argv)

    by_suffix = models()
    plain = by_suffix[""]
    rng = np.random.default_rng(0)
    micro = {"x": jnp.asarray(rng.standard_normal((N, B, 6)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, (N, B)), jnp.int32)}
    flat = jax.tree.map(lambda a: a.reshape(N * B, *a.shape[2:]), micro)
    key = jax.random.key(7)
    mesh = jax.make_mesh((M,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="jaxstream-engines-"))
    for i, (name, (est, layout)) in enumerate(estimators(plain.num_layers).items()):
        stack = by_suffix[suffix(name)]
        params = stack.init(jax.random.key(0))
        exact = jax.grad(stack)(params, flat)
        data = flat if layout == "flat" else micro
        ref = jax.jit(est, static_argnums=0)(stack, params, data, key)[1]
        dp = functools.partial(data_parallel, est, mesh, tangents="shared",  # refusals: a row
                               batch_axis=0 if layout == "flat" else 1)
        runs = {
            "memory": lambda ref=ref: (ref, None),
            "dataparallel": lambda data=data, dp=dp, params=params, stack=stack: (jax.jit(dp(), static_argnums=0)(stack, params, data,
                                                                      key)[1], None),
            "pipeline": lambda est=est, name=name, params=params, stack=stack: run_pipeline(name, est, stack, params, micro, key),
            "stream": lambda est=est, i=i, params=params, stack=stack: (run_stream(est, stack, params, micro, key, tmp / f"s{i}"), None),
            "composed": lambda est=est, i=i, params=params, stack=stack: (run_composed(est, stack, params, micro, key, tmp / f"c{i}"),
                                 None),
        }
        for engine in ("memory", *ENGINES):
            fn = runs[engine]
            row = {"engine": engine, "estimator": name}
            try:
                grads, own_ref = fn()
            except (ValueError, TypeError) as err:
                row.update(status="refused", max_rel_err=None, whole_rel_err=None,
                           leaf_rel_err=None, cosine_to_exact=None,
                           reason=str(err).splitlines()[0][:160])
            else:
                e = gradient_error(grads, own_ref or ref)
                row.update(status="ran", max_rel_err=e.max, whole_rel_err=e.whole,
                           leaf_rel_err=e.leaf, worst_leaf=e.worst,
                           cosine_to_exact=cosine(grads, exact),
                           reference="same" if own_ref is None else "per-micro-batch")
            rows.append(row)
            err = "" if row["max_rel_err"] is None else f"{row['max_rel_err']:.2e}"
            cos = "" if row["cosine_to_exact"] is None else f"{row['cosine_to_exact']:+.3f}"
            print(f"{engine:>12} {name:<14} {row['status']:<8} {err:>9} {cos:>7}", flush=True)
    table = _print_matrix(rows)
    if args.doc:
        write_tables(args.doc, "engines.py", {"matrix": table},
                     "python benchmarks/engines.py --quick --doc " + args.doc)
    out = {"rows": rows, "model": {"depth": M, "width": 8, "micro_batches": N, "examples": B},
           "machine": machine()}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


def _print_matrix(rows) -> str:
    """Print the matrix; return it as a Markdown table."""
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    names = list(dict.fromkeys(r["estimator"] for r in rows))
    cell = {(r["engine"], r["estimator"]): r for r in rows}

    def text(r):
        if r["status"] != "ran":
            return "refused"
        mark = {"same": "", "per-micro-batch": " ᵖ"}[r["reference"]]
        return f"{r['max_rel_err']:.1e}{mark} ({r['cosine_to_exact']:+.3f})"

    print("\nmax relative error against the in-memory estimator (cosine to the exact gradient)")
    print(f"{'estimator':<15}" + "".join(f"{e:>24}" for e in engines))
    for n in names:
        print(f"{n:<15}" + "".join(f"{text(cell[(e, n)]):>24}" for e in engines))
    md = ["| estimator | " + " | ".join(engines) + " |", "|---" * (len(engines) + 1) + "|"]
    md += [f"| {n} | " + " | ".join(text(cell[(e, n)]) for e in engines) + " |" for n in names]
    return "\n".join(md)


if __name__ == "__main__":
    main()
