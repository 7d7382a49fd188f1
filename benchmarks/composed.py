"""The composed engine (streamed pipeline stages over a data × stage mesh) against the
in-memory pipeline's policies, side by side in one run.

    python benchmarks/composed.py --quick --json out.json     # small sizes
    python benchmarks/composed.py --doc docs/composed.md      # also rewrite the doc's tables

rows, one per (mesh, policy, estimator): ``max_rel_err`` against the in-memory estimator for
the same keys; ``ticks`` / ``added_ticks`` in one-layer ticks (a tick in which every stage
runs one layer for one micro-batch; an in-memory pipeline's tick runs L/M layers per stage, so
its ticks are scaled by L/M) and added against the forward-only pass; ``fill_ratio`` (the
forward-only pass's idle cells that reverse work fills); ``coverage_per_stage`` (fraction of
micro-batches with an exact gradient at each stage) and ``staleness_per_stage`` (steps); for
streamed rows also the measured ticks against :func:`jaxstream.compose.chunk_cost` and the
layers read per step. scale: a model ≥ 30× the resident budget per device streamed through
a 2 × 4 mesh in a fresh process; its peak RSS above the process's constant (imports, runtime,
compiled kernels, measured after a first step) against the budget summed over the devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, chunk_cost, make_mesh
from jaxstream.models import mlp
from jaxstream.stream import DepthPolicy, LayerStore, StreamConfig

HERE = Path(__file__).resolve().parent
MiB = 2**20
FP32 = StreamConfig(compute_dtype="float32", prefetch=1)
N, B, K, SEL = 8, 4, 2, 2

ESTIMATORS = {  # name: (estimator, reference batch layout, cost-model kind)
    "forward": (jg.forward(num_tangents=K), "flat", "forward"),
    "backprop": (jg.backprop(), "flat", "backprop"),
    "hybrid_cv": (jg.hybrid(num_exact=SEL, num_tangents=K), "micro", "hybrid_cv"),
    "hybrid_weighted": (jg.hybrid(num_exact=SEL, correction="weighted", num_tangents=K),
                        "micro", "hybrid_cv"),
    "hybrid_stein": (jg.hybrid(num_exact=SEL, correction="stein", num_tangents=K), "micro",
                     "hybrid_cv"),
    "hybrid_replace": (jg.hybrid(num_exact=SEL, correction="replace", num_tangents=K),
                       "micro", "hybrid_replace"),
    "hybrid_guess": (jg.hybrid(num_exact=SEL, correction="guess", num_tangents=K), "micro",
                     "hybrid_guess"),
    "activity": (jg.forward(num_tangents=K, perturb="activations"), "flat", "activity"),
    "activity_local": (jg.forward(num_tangents=K, perturb="activations", local_losses=True),
                       "flat", "local"),
}


def _load_pipeline_bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", HERE / "pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def max_rel_err(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                     / (np.max(np.abs(np.asarray(y, np.float64))) + 1e-30))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def coverage(est, n: int, layers: int, stages: int, key) -> list[float]:
    """Per stage: the fraction of micro-batches whose exact gradient reaches its layers."""
    if isinstance(est, jg.Backprop):
        return [1.0] * stages
    if not isinstance(est, jg.Hybrid):
        return [0.0] * stages
    depth = np.asarray(est.selection(n, key, layers)[1])  # per selected micro-batch
    per_layer = [(depth <= l).sum() / n for l in range(layers)]
    return [float(np.mean(per_layer[s::stages])) for s in range(stages)]  # layer cM+s on s


def streamed_rows(meshes, layers: int, names) -> list[dict]:
    stack = mlp(16, 16, layers, 10)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, B, 16), dtype=np.float32)
    y = rng.integers(0, 10, (N, B), dtype=np.int32)
    micro, flat = {"x": x, "y": y}, {"x": x.reshape(N * B, 16), "y": y.reshape(N * B)}
    key = jax.random.key(3)
    rows = []
    for d, s in meshes:
        mesh = make_mesh(d, s)
        for name in names:
            est, layout, kind = ESTIMATORS[name]
            with tempfile.TemporaryDirectory() as tmp:
                store = LayerStore.create(Path(tmp) / "s", params, optimizer=optax.sgd(0.1))
                ex = ComposedExecutor(stack, est, optax.sgd(0.1), store, FP32, mesh=mesh)
                t0 = time.perf_counter()
                _, grads = ex.estimate(micro, key)
                first_s = time.perf_counter() - t0
                ex.ticks = 0
                t0 = time.perf_counter()
                m = ex.step(micro, key)
                step_s = time.perf_counter() - t0
            _, ref = jax.jit(est, static_argnums=0)(stack, params,
                                                    flat if layout == "flat" else micro, key)
            model = chunk_cost(kind, layers=layers, stages=s, micro_batches=N, selected=SEL,
                               prefetch=FP32.prefetch)
            merged = kind in ("activity", "local")  # N micro-batches as one pass
            fwd = chunk_cost("forward", layers=layers, stages=s,
                             micro_batches=1 if merged else N).ticks
            rows.append({
                "data": d, "stage": s, "policy": "chunked", "estimator": name, "streamed": True,
                "max_rel_err": max_rel_err(grads, ref), "ticks": m["ticks"],
                "ticks_model": model.ticks, "added_ticks": m["ticks"] - fwd,
                "fill_ratio": 0.0,  # reverse chains run in their own passes
                "coverage_per_stage": coverage(est, N, layers, s, key),
                "staleness_per_stage": [0] * s, "layers_read": m["layers_read"],
                "layers_read_model": model.layer_reads, "first_call_s": first_s,
                "step_s": step_s})
            print(f"  {d}x{s} {name:16s} err {rows[-1]['max_rel_err']:.2e} ticks {m['ticks']} "
                  f"(model {model.ticks})", flush=True)
    return rows


def in_memory_rows(m: int, layers: int, quick: bool) -> list[dict]:
    """The in-memory pipeline (stage axis only) with each policy, from benchmarks/pipeline.py:
    its executor's error for the bubble policies, table measures for the backprop tables."""
    pb = _load_pipeline_bench()
    from jaxstream.pipeline import gpipe_backprop, one_f_one_b
    from jaxstream.pipeline.metrics import summary

    per = layers // m
    pols = ("forward", "delayed", "crossstep") if quick else (
        "forward", "truncated", "delayed", "complete", "crossstep")
    rows = []
    for r in pb.executor_rows(m, N, SEL, pols):
        rows.append(_mem_row(r, m, per, "forward" if r["policy"] == "forward" else "hybrid_cv"))
    for name, table in (("gpipe-backprop", gpipe_backprop(m, N)), ("1f1b", one_f_one_b(m, N))):
        rows.append(_mem_row({**summary(table), "max_rel_err": None}, m, per, "backprop"))
    return rows


def _mem_row(r: dict, m: int, per: int, estimator: str) -> dict:
    return {"data": 1, "stage": m, "policy": r["policy"], "estimator": estimator,
            "streamed": False, "max_rel_err": r["max_rel_err"],
            "ticks": r["makespan_ticks"] * per, "added_ticks": r["added_ticks"] * per,
            "fill_ratio": r["fill_ratio"], "coverage_per_stage": list(r["coverage_per_stage"]),
            "staleness_per_stage": list(r["staleness_per_stage"])}


# ---------------------------------------------------------------------------- scale
def scale_worker(args) -> None:
    """In a fresh process: a store written layer by layer, one step (compilation: part of the
    constant), then the RSS high-water mark over the following steps."""
    bench = importlib.util.spec_from_file_location("bench_streaming", HERE / "streaming.py")
    sb = importlib.util.module_from_spec(bench)
    bench.loader.exec_module(sb)
    d, s = args.mesh
    est, opt, mesh = jg.hybrid(num_exact=SEL, num_tangents=K), optax.sgd(1e-3), make_mesh(d, s)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((N, d, 64), dtype=np.float32),
             "y": rng.integers(0, 10, (N, d), dtype=np.int32)}
    # the constant: runtime, imports and every compiled kernel: step 0 runs the first two
    # chunks of the model (a progressive depth policy), every later step all of it
    store, stack = sb.build_store(Path(args.dir) / "big", args.width, args.layers,
                                  optimizer=opt, max_write_bytes=args.budget // 4)
    cfg = dataclasses.replace(FP32, depth=DepthPolicy("progressive", start=2 * s,
                                                      grow=args.layers, every=1))
    ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=mesh)
    ex.step(batch, jax.random.key(0))
    baseline = sb.current_rss()
    reset = sb.reset_peak_rss()
    times = []
    for i in range(args.steps):
        m = ex.step(batch, jax.random.key(i + 1))
        assert m["layers_read"] == 3 * args.layers, m  # the whole model streamed
        times.append(m["step_time_s"])
    peak = sb.peak_rss_since_reset() if reset else None
    print(json.dumps({"model_bytes": store.layer_bytes * args.layers,
                      "layer_bytes": store.layer_bytes, "baseline_rss_bytes": baseline,
                      "peak_rss_bytes": peak, "peak_reset": reset, "step_s": times}))


def scale(width: int, layers: int, steps: int, mesh=(2, 4), repeats: int = 3) -> dict:
    """The scale measurement in ``repeats`` fresh processes (the RSS high-water mark varies
    between runs: every run is reported, the largest is compared with the budget)."""
    layer_bytes = width * width * 4 + width * 4
    # each device: its stage's layer of the computing chunk and of the prefetched one, and the
    # exact gradients of the SEL selected micro-batches for its current layer (a hybrid keeps
    # them until the group mean); twice, for the host's staging copies (read, device_get)
    budget = 2 * (FP32.prefetch + 1 + SEL) * layer_bytes
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--scale-worker", "--dir", tmp, "--width",
                   str(width), "--layers", str(layers), "--steps", str(steps), "--budget",
                   str(budget), "--mesh", str(mesh[0]), str(mesh[1])]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_ARENA_MAX="2")
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if out.returncode:
                raise RuntimeError(f"scale worker failed:\n{out.stderr[-4000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    r = runs[0]
    above = ([x["peak_rss_bytes"] - x["baseline_rss_bytes"] for x in runs]
             if all(x["peak_reset"] for x in runs) else None)
    devices = mesh[0] * mesh[1]
    return {"model_bytes": r["model_bytes"], "budget_bytes": budget,
            "model_over_budget": r["model_bytes"] / budget,
            "peak_rss_above_baseline_bytes": None if above is None else max(above),
            "peak_rss_above_baseline_each_run_bytes": above,
            "budget_summed_over_devices_bytes": budget * devices,
            "within_budget": above is not None and max(above) <= budget * devices,
            "baseline_rss_bytes": r["baseline_rss_bytes"], "mesh": list(mesh),
            "step_s": [x["step_s"] for x in runs]}


# ---------------------------------------------------------------------------- output
COLS = ("data", "stage", "policy", "estimator", "streamed", "max_rel_err", "ticks", "added_ticks",
        "fill_ratio", "coverage_per_stage", "staleness_per_stage")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return " ".join(_fmt(x) for x in v)
    return str(v)


def markdown(rows: list[dict], sc: dict, command: str) -> str:
    head = "| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS) + "\n"
    body = "".join("| " + " | ".join(_fmt(r.get(c)) for c in COLS) + " |\n" for r in rows)
    s = (f"\nscale (mesh {sc['mesh'][0]} × {sc['mesh'][1]}): model {sc['model_bytes'] / MiB:.1f} "
         f"MiB = {sc['model_over_budget']:.1f} × the resident budget of "
         f"{sc['budget_bytes'] / MiB:.2f} MiB per device; peak RSS above the constant "
         f"{_fmt((sc['peak_rss_above_baseline_bytes'] or 0) / MiB)} MiB (largest of "
         f"{_fmt([round(b / MiB, 2) for b in sc['peak_rss_above_baseline_each_run_bytes'] or []])}"
         f" in fresh processes) against "
         f"{sc['budget_summed_over_devices_bytes'] / MiB:.1f} MiB summed over the devices "
         f"(constant {sc['baseline_rss_bytes'] / MiB:.0f} MiB).\n")
    return (f"Written by `{command}` on {platform.node() or 'this machine'} "
            f"({os.cpu_count()} CPU cores, simulated devices), jax {jax.__version__}.\n\n"
            + head + body + s)


def write_doc(path: Path, block: str) -> None:
    begin, end = "<!-- composed-table:begin -->", "<!-- composed-table:end -->"
    text = path.read_text()
    i, j = text.index(begin) + len(begin), text.index(end)
    path.write_text(text[:i] + "\n" + block + text[j:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer meshes and estimators")
    ap.add_argument("--json", type=Path, help="write {rows, scale} here")
    ap.add_argument("--doc", type=Path, help="rewrite the table block of this markdown file")
    ap.add_argument("--scale-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mesh", type=int, nargs=2, default=(2, 4), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scale_worker:
        scale_worker(args)
        return 0
    layers = 8
    if args.quick:
        meshes, names = ((1, 4), (2, 4)), ("forward", "backprop", "hybrid_cv", "hybrid_weighted",
                                          "hybrid_guess", "activity")
    else:
        meshes, names = ((1, 4), (2, 4), (2, 2), (4, 2)), tuple(ESTIMATORS)
    print("streamed (composed engine):", flush=True)
    rows = streamed_rows(meshes, layers, names)
    print("in-memory pipeline (stage axis):", flush=True)
    rows += in_memory_rows(4, layers, args.quick)
    print("scale:", flush=True)
    sc = scale(128 if args.quick else 256, 256, 1 if args.quick else 2)
    for r in rows:
        print("  ".join(f"{c}={_fmt(r.get(c))}" for c in COLS))
    print(json.dumps(sc, indent=1))
    command = "python benchmarks/composed.py" + (" --quick" if args.quick else "")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "scale": sc, "command": command,
                                         "machine": platform.node(), "cpus": os.cpu_count()},
                                        indent=1))
        print(f"wrote {args.json}")
    if args.doc:
        write_doc(args.doc, markdown(rows, sc, command + f" --doc {args.doc}"))
        print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
