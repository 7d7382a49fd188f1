"""Pipeline schedules and executor: ticks, bubbles filled, stash, compile time, gradient quality.

    python benchmarks/pipeline.py --quick --json /tmp/pipeline.json

Tables (NumPy): over M in {2, 4, 8}, N in {M, 2M, 4M, 8M}, k selected micro-batches: makespan in
ticks and cost-weighted (F/B/W costs measured here on one MLP stage), idle fraction against
(M-1)/(N+M-1), fill ratio, exact-gradient coverage and peak stash, for forward-only GPipe, the
truncated / delayed (stale by one step) / complete / crossstep (full stale chains, fewest added
ticks; "crossstep-0" = the most stale coverage with zero added ticks) policies, and GPipe / 1F1B
with backprop; per-stage coverage and staleness for M in {4, 8}, N in {8, 16}, k in {1, 2, M/2}
(``--doc docs/pipeline.md`` rewrites that table in the doc).
Executor (8 simulated CPU devices): compile time of each policy's pipeline, max relative error
against the single-device hybrid estimator for the same keys and groups, and cosine of the
corrected gradient to the exact gradient of the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp

import jaxstream.grad as jg
from jaxstream.experiment.docblock import write_tables
from jaxstream.grad.tangents import TangentSpec, combine, micro_key
from jaxstream.models import mlp
from jaxstream.pipeline import (
    OpCosts,
    crossstep,
    gpipe_backprop,
    gpipe_forward,
    gpipe_idle_fraction,
    make_schedule,
    max_coverage,
    min_added_ticks,
    one_f_one_b,
    summary,
)
from jaxstream.pipeline.executor import pipeline
from jaxstream.pipeline.lowering import exact_from
from jaxstream.pipeline.stage_ops import StageOps

KEYS = ("M", "N", "k", "policy", "makespan_ticks", "added_ticks", "fill_ratio", "coverage",
        "peak_stash", "max_rel_err")


def _time(fn, *args, reps=20) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def measure_costs(width=128, layers=2, micro=32, k=1) -> OpCosts:
    """Seconds of F (jvp, K tangents), B (input vjp) and W (weight vjp) of one MLP stage."""
    stack = mlp(64, width, layers, 10)
    p = stack.init(jax.random.key(0))
    ops = StageOps(stack, TangentSpec(k), 0)
    h = jnp.ones((micro, width))
    dh = jnp.ones((k, micro, width))
    key = jax.random.key(1)
    f = jax.jit(lambda p, h, dh: ops.forward_mid(p, h, dh, key))
    b = jax.jit(lambda p, h: ops.backward("mid", p, h, h, None, True, False)[0])
    w = jax.jit(lambda p, h: ops.backward("mid", p, h, h, None, False, True)[1])
    return OpCosts(_time(f, p, h, dh), _time(b, p, h), _time(w, p, h))


def table_rows(ms, costs: OpCosts) -> list[dict]:
    rows = []
    for m in ms:
        for n in (m, 2 * m, 4 * m, 8 * m):
            base = [("forward", gpipe_forward(m, n), 0), ("gpipe-backprop", gpipe_backprop(m, n), n),
                    ("1f1b", one_f_one_b(m, n), n)]
            for k in (1, 2, 4):
                if k > n:
                    continue
                for pol in ("truncated", "delayed", "complete", "crossstep", "crossstep-0"):
                    base.append((pol, _schedule(pol, m, n, tuple(range(k)), costs), k))
            fwd_w = summary(gpipe_forward(m, n), costs)["weighted_makespan"]
            for pol, s, k in base:
                r = summary(s, costs)
                rows.append({
                    "M": m, "N": n, "k": k, "policy": pol, "makespan_ticks": r["makespan_ticks"],
                    "added_ticks": r["added_ticks"], "fill_ratio": r["fill_ratio"],
                    "coverage": r["coverage"], "peak_stash": r["peak_stash"], "max_rel_err": None,
                    "weighted_makespan_s": r["weighted_makespan"],
                    "weighted_ratio_to_forward": r["weighted_makespan"] / fwd_w,
                    "idle_fraction": r["idle_fraction"],
                    "idle_formula": gpipe_idle_fraction(m, n) if pol == "forward" else None,
                    "stale": r["stale"],
                    "coverage_per_stage": r["coverage_per_stage"],
                    "staleness_per_stage": r["staleness_per_stage"],
                })
    return rows


def _schedule(pol: str, m: int, n: int, sel: tuple, costs: OpCosts | None = None):
    """A policy's table; crossstep gets the fewest added ticks, crossstep-0 none (max coverage)."""
    if pol == "crossstep":
        return crossstep(m, n, sel, added_ticks=min_added_ticks(m, n, len(sel)))
    if pol == "crossstep-0":
        return max_coverage(m, n, sel, added_ticks=0)
    return make_schedule(pol, m, n, sel, costs or OpCosts())


def _per_stage(v) -> str:
    return " ".join("-" if x is None else f"{x:.3g}" for x in v)


def coverage_markdown(rows) -> str:
    """The per-stage coverage / staleness table (M in {4, 8}, N in {8, 16}, k in {1, 2, M/2})."""
    out = [("| M | N | k | policy | added ticks | fill ratio | coverage per stage (s0 … s{M-1}) "
            "| staleness per stage (steps) |"), "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["M"] not in (4, 8) or r["N"] not in (8, 16):
            continue
        if r["k"] not in (1, 2, r["M"] // 2) and r["policy"] not in ("forward", "gpipe-backprop", "1f1b"):
            continue
        out.append(f"| {r['M']} | {r['N']} | {r['k']} | {r['policy']} | {r['added_ticks']} | "
                   f"{r['fill_ratio']:.3f} | {_per_stage(r['coverage_per_stage'])} | "
                   f"{_per_stage(r['staleness_per_stage'])} |")
    return "\n".join(out)


def _flat(t):
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)])


def executor_rows(m: int, n: int, k: int, policies) -> list[dict]:
    """Compile time, error vs the single-device estimator, cosine to the exact gradient."""
    stack = mlp(64, 32, m, 10)
    params = stack.init(jax.random.key(0))
    mk = lambda s: {"x": jax.random.normal(jax.random.key(s), (n, 4, 64)),
                    "y": jax.random.randint(jax.random.key(s + 1), (n, 4), 0, 10)}
    batch, prev = mk(1), mk(11)
    key = jax.random.key(5)
    kt = 4
    exact = jax.jit(jax.grad(lambda p, b: jnp.mean(jax.vmap(lambda x: stack(p, x))(b))))(
        params, batch)
    rows = []
    for pol in policies:
        sel = tuple(range(k))
        sched = _schedule(pol, m, n, sel)
        corr = "none" if pol == "forward" else "control_variate"
        pipe = pipeline(stack, sched, num_tangents=kt, correction=corr)
        t0 = time.perf_counter()
        if pipe.stale:
            carry = pipe.init_carry(params, prev)
            out = pipe(params, prev, jax.random.key(4), carry)
            jax.block_until_ready(out)
            compile_s = time.perf_counter() - t0
            _, grads, _ = pipe(params, batch, key, out[2]["carry"])
        else:
            _, grads, _ = pipe(params, batch, key)
            jax.block_until_ready(grads)
            compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        spec = TangentSpec(kt)
        keys = jax.vmap(lambda i: micro_key(key, i))(jnp.arange(n))

        def fwd_ref(p, b, spec=spec, keys=keys):
            _, d = jax.vmap(lambda bb, kk: jg.stack_directional(stack, spec, p, bb, kk))(b, keys)
            return d

        d = jax.jit(fwd_ref)(params, batch)
        if pol == "forward":
            ref = combine(spec, keys, d / (n * kt), params)
        elif pipe.stale:
            from jaxstream.grad import corrections as cr
            ps = jnp.array(pipe.lowered.prev_selected)
            ex = jax.vmap(lambda b: jax.grad(stack)(params, b))(jax.tree.map(lambda a, ps=ps: a[ps], prev))
            depth = jnp.array([exact_from(sched, m)[j] for j in pipe.lowered.selected])
            h, _ = cr.group_mean(ex, cr.group_masks(params, depth), params)
            ref = cr.control_variate(spec, keys, d, h, cr.residual_scalars(spec, keys, h), params)
        else:
            est = jg.hybrid(exact_from=exact_from(sched, m), correction=corr, num_tangents=kt)
            ref = jax.jit(lambda p, b, est=est: est(stack, p, b, key)[1])(params, batch)
        err = float(jnp.max(jnp.abs(_flat(grads) - _flat(ref))) / jnp.max(jnp.abs(_flat(ref))))
        g, e = _flat(grads), _flat(exact)
        cos = float(jnp.vdot(g, e) / (jnp.linalg.norm(g) * jnp.linalg.norm(e)))
        s = summary(sched)
        rows.append({"M": m, "N": n, "k": k if pol != "forward" else 0, "policy": sched.name,
                     "makespan_ticks": s["makespan_ticks"], "added_ticks": s["added_ticks"],
                     "fill_ratio": s["fill_ratio"], "coverage": s["coverage"],
                     "peak_stash": s["peak_stash"], "max_rel_err": err, "cosine_to_exact": cos,
                     "compile_s": compile_s, "num_tangents": kt, "stale": s["stale"],
                     "coverage_per_stage": s["coverage_per_stage"],
                     "staleness_per_stage": s["staleness_per_stage"]})
    return rows


def _print(rows, keys):
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    widths = [max(len(k), *(len(fmt(r.get(k))) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(k)).rjust(w) for k, w in zip(keys, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sweep (< 2 minutes)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--doc", type=Path, help="rewrite the per-stage table in this markdown file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    costs = measure_costs()
    print(f"measured op costs (s): F={costs.f:.2e} B={costs.b:.2e} W={costs.w:.2e}")
    rows = table_rows((2, 4, 8), costs)
    sel = [r for r in rows if r["M"] == 4 and r["N"] == 16]
    print("\nschedules, M=4 N=16 (cost-weighted makespan with the measured costs):")
    _print(sel, ("policy", "k", "makespan_ticks", "added_ticks", "weighted_ratio_to_forward",
                 "idle_fraction", "idle_formula", "fill_ratio", "coverage", "peak_stash"))
    print("\nper-stage exact-gradient coverage and staleness (steps), M in {4, 8}, N in {8, 16}:")
    table = coverage_markdown(rows)
    print(table)
    n_exec = 8
    policies = ("forward", "truncated", "delayed", "complete", "crossstep")
    ex_rows = executor_rows(8, n_exec, 2, policies)
    if not args.quick:
        ex_rows += executor_rows(8, 32, 4, policies)
    print("\nexecutor, 8 simulated devices, 8-block MLP, K=4 tangents:")
    _print(ex_rows, ("policy", "N", "k", "added_ticks", "coverage", "peak_stash", "compile_s",
                     "max_rel_err", "cosine_to_exact"))
    bad = [r for r in rows if r["policy"] == "forward"
           and abs(r["idle_fraction"] - r["idle_formula"]) > 1e-12]
    print(f"\nforward-only idle fraction == (M-1)/(N+M-1) for all {len(rows)} table rows: "
          f"{not bad}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.doc:
        cmd = "python benchmarks/pipeline.py" + (" --quick" if args.quick else "")
        write_tables(args.doc, "pipeline.py", {"policies": table}, cmd + f" --doc {args.doc}")
        print(f"rewrote the per-stage table in {args.doc}")
    if args.json:
        args.json.write_text(json.dumps(rows + ex_rows, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
