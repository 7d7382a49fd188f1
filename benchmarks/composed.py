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
layers read per step, counted by the store's reads, against the model's — with ``update``
"eager" and, for every estimator with an update sweep, "lazy" (the update applied when the
layer is next read: a control-variate hybrid reads 2 L − M layers per step). Every count and
time is of a row's second step, so a deferred update (applied in the step after) is in it.

scale: a model ≥ 30× the resident budget per device streamed through a 2 × 4 mesh (hybrid
control variate, S = 2 exact micro-batches, prefetch p = 1 chunk, SGD), at two depths of the
same width, each in fresh processes. Reported: the peak RSS above the process's constant
(imports, runtime, compiled kernels: the RSS at rest after a first step that runs two chunks of
the same layers) against the budget summed over the devices plus the depth's activation stash,
and the RSS at rest after every measured step (a leak would grow it). The budget counts, in
layers of fp32 parameters, what the engine holds for the layers in flight in one process
(:func:`resident_terms`), divided by the data × stage devices:

- device copies: each device's layer of p + 2 chunks (computing, prefetched, and the previous
  chunk until its arrays are released), D × M × (p + 2);
- host read buffers of those chunks (the direct reads' pool), M × (p + 2);
- the passes' buffers on each device: the temporaries and outputs of the largest compiled
  pass (XLA's memory analysis, recorded in the first step; the vjp pass, whose outputs are
  the S per-micro-batch exact gradients of the device's layer), D × M × that;
- exact gradients on the host, one layer at a time: its S gradients read from its device,
  their fp32 copies for the host's group mean, and the mean h_u, 2 × S + 1;
- the host optimizer update of one layer (params, gradient, new params; and twice the
  optimizer state per state leaf: none for SGD), 3 + 2 × opt_leaves;
- staged writes in flight (the store's ``max_write_bytes``, set to 2 layers).

Not in the budget, because they are not parameters, and growing with depth: the hybrid's
stash of the S selected micro-batches' block inputs, S × B × width × 4 bytes per layer, which a
reverse sweep needs (the allowed peak adds it); and the step's per-layer bookkeeping on the host
(timeline events, group memberships, the parts of the scalars c_nk, the stash's array views),
small Python objects kept until the step ends, whose high-water mark the allocators then keep
(the RSS at rest after the first full step). Both are per layer a small fraction of a layer's
parameters; the peak above the constant at the two depths shows what they add.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
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
from jaxstream.compose.cost import LAZY
from jaxstream.experiment.docblock import machine, write_tables
from jaxstream.models import mlp
from jaxstream.quality.metrics import max_rel_err
from jaxstream.stream import DepthPolicy, LayerStore, StreamConfig, StreamedExecutor

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
    runs = [(name, up) for name in names
            for up in (("eager", "lazy") if ESTIMATORS[name][2] in LAZY else ("eager",))]
    for d, s in meshes:
        mesh = make_mesh(d, s)
        for name, update in runs:
            est, layout, kind = ESTIMATORS[name]
            cfg = dataclasses.replace(FP32, update=update)
            with tempfile.TemporaryDirectory() as tmp:
                store = LayerStore.create(Path(tmp) / "s", params, optimizer=optax.sgd(0.1))
                ex = ComposedExecutor(stack, est, optax.sgd(0.1), store, cfg, mesh=mesh)
                t0 = time.perf_counter()
                _, grads = ex.estimate(micro, key)
                first_s = time.perf_counter() - t0
                ex.step(micro, key)  # a deferred update is applied in the step after
                ex.ticks = 0
                t0 = time.perf_counter()
                m = ex.step(micro, jax.random.key(4))  # the second step: timed, counted
                step_s = time.perf_counter() - t0
            _, ref = jax.jit(est, static_argnums=0)(stack, params,
                                                    flat if layout == "flat" else micro, key)
            cost = functools.partial(chunk_cost, kind, layers=layers, stages=s,
                                     micro_batches=N, selected=SEL, prefetch=FP32.prefetch,
                                     update=update)
            model = cost()
            merged = kind in ("activity", "local")  # N micro-batches as one pass
            fwd = chunk_cost("forward", layers=layers, stages=s,
                             micro_batches=1 if merged else N).ticks
            rows.append({
                "data": d, "stage": s, "policy": "circular", "estimator": name, "update": update,
                "streamed": True,
                "max_rel_err": max_rel_err(grads, ref), "ticks": m["ticks"],
                "ticks_model": model.ticks, "ticks_chunked": cost(schedule="chunked").ticks,
                "added_ticks": m["ticks"] - fwd, "fill_ratio": m["fill_ratio"],
                "coverage_per_stage": coverage(est, N, layers, s, key),
                "staleness_per_stage": [0] * s, "layers_read": m["layers_read"],
                "layer_reads_per_layer": m["layers_read"] / layers,
                "bytes_read": m["bytes_read"], "bytes_written": m["bytes_written"],
                "layers_read_model": model.layer_reads, "first_call_s": first_s,
                "step_s": step_s, **{f"idle_{k}": m[k] for k in
                                     ("stall_s", "host_update_s", "wait_update_s",
                                      "wait_write_s")}})
            print(f"  {d}x{s} {name:16s} {update:5s} reads {m['layers_read']} (model "
                  f"{model.layer_reads}) err {rows[-1]['max_rel_err']:.2e} ticks {m['ticks']} "
                  f"(model {model.ticks}, chunked {rows[-1]['ticks_chunked']}) fill "
                  f"{m['fill_ratio']:.3f}", flush=True)
    return rows


def deep_rows(layers: int = 64, stages: int = 8, n: int = 16, selections=(1, 2, 8)) -> list:
    """The control-variate hybrid at L = 64, M = 8, N = 16 for each S, executed on a narrow
    model: the step's ticks and bubble fraction counted by its passes, beside the chunked
    schedule's formula and MaxText's circular bubble (M − 1)/(C·N + M − 1) for the forward
    sweep (measured alone with :meth:`ComposedExecutor.forward`)."""
    stack = mlp(8, 8, layers, 4)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((n, 2, 8), dtype=np.float32),
             "y": rng.integers(0, 4, (n, 2), dtype=np.int32)}
    c, out = layers // stages, []
    for sel in selections:
        est = jg.hybrid(num_exact=sel, num_tangents=K)
        with tempfile.TemporaryDirectory() as tmp:
            store = LayerStore.create(Path(tmp) / "s", params, optimizer=optax.sgd(0.1))
            ex = ComposedExecutor(stack, est, optax.sgd(0.1), store, FP32,
                                  mesh=make_mesh(1, stages))
            m = ex.step(micro, jax.random.key(1))
            ex.placement.begin_step()
            ex.forward(micro, jax.random.key(1))
            fwd_ticks, fwd_busy = ex.placement.ticks, ex.placement.busy_per_stage()
        cost = functools.partial(chunk_cost, "hybrid_cv", layers=layers, stages=stages,
                                 micro_batches=n, selected=sel)
        out.append({"layers": layers, "stages": stages, "micro_batches": n, "selected": sel,
                    "ticks": m["ticks"], "ticks_model": cost().ticks,
                    "ticks_chunked": cost(schedule="chunked").ticks,
                    "bubble_fraction": 1.0 - m["fill_ratio"],
                    "bubble_fraction_chunked": cost(schedule="chunked").bubble_fraction,
                    "forward_ticks": fwd_ticks,
                    "forward_bubble_fraction": 1.0 - fwd_busy.sum() / (fwd_ticks * stages),
                    "maxtext_forward_bubble": (stages - 1) / (c * n + stages - 1),
                    "layers_read": m["layers_read"], "executed": True})
        print(f"  deep S={sel}: ticks {m['ticks']} (model {out[-1]['ticks_model']}, chunked "
              f"{out[-1]['ticks_chunked']}), bubble {out[-1]['bubble_fraction']:.3f}, forward "
              f"bubble {out[-1]['forward_bubble_fraction']:.4f} (MaxText "
              f"{out[-1]['maxtext_forward_bubble']:.4f})", flush=True)
    return out


def overlap_rows(steps: int = 6, layers: int = 16, width: int = 256) -> list[dict]:
    """The host optimizer beside the sweeps against in line, in the same run: median step time
    of a control-variate hybrid (Adam) on the one-device streamed executor and on a 2 × 4 mesh,
    and the time the step waited for the host update."""
    stack = mlp(width, width, layers, 10)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((N, 8, width), dtype=np.float32),
             "y": rng.integers(0, 10, (N, 8), dtype=np.int32)}
    est, out = jg.hybrid(num_exact=SEL, num_tangents=K), []
    for mesh in (None, (2, 4)):
        for overlap in (False, True):
            cfg = dataclasses.replace(FP32, overlap_update=overlap)
            with tempfile.TemporaryDirectory() as tmp:
                store = LayerStore.create(Path(tmp) / "s", params, optimizer=optax.adam(1e-3))
                ex = (StreamedExecutor(stack, est, optax.adam(1e-3), store, cfg) if mesh is None
                      else ComposedExecutor(stack, est, optax.adam(1e-3), store, cfg,
                                            mesh=make_mesh(*mesh)))
                ms = [ex.step(micro, jax.random.key(i)) for i in range(steps + 1)][1:]
            out.append({"engine": "stream" if mesh is None else f"composed {mesh[0]}x{mesh[1]}",
                        "overlap_update": overlap,
                        "step_s": float(np.median([m["step_time_s"] for m in ms])),
                        "wait_update_s": float(np.median([m["wait_update_s"] for m in ms])),
                        "host_update_s": float(np.median([m["host_update_s"] for m in ms]))})
            print(f"  {out[-1]['engine']:14s} overlap={overlap!s:5s} step "
                  f"{out[-1]['step_s']:.3f} s, waited for updates {out[-1]['wait_update_s']:.3f}"
                  f" s of {out[-1]['host_update_s']:.3f} s", flush=True)
    for r in out:
        base = next(x for x in out if x["engine"] == r["engine"] and not x["overlap_update"])
        r["step_ratio_to_in_line"] = r["step_s"] / base["step_s"]
    return out


def overlap_efficiency(steps: int = 4, layers: int = 16, width: int = 256,
                       mesh=(2, 4)) -> list[dict]:
    """A composed step against its two parts, same run, full size (no --quick shrinking): the
    step (control-variate hybrid, Adam, store on disk), the same steps compute-only (the store
    in memory: ``memory://``, no file I/O) and I/O-only (the step's layer reads — as many as
    its ``layers_read``, sweep by sweep, prefetched as the step does —, every layer's
    optimizer state, then every layer's write and the commit, with no compute).
    ``efficiency`` = (compute + io − step) / min(compute, io): 1 when the shorter part is
    hidden entirely, 0 when the two run one after the other, below 0 when the step costs more
    than both (fixed costs of the I/O path that the parts do not see). The file reads come
    from the page cache (the store was just written)."""
    from jaxstream.stream.prefetch import Prefetcher

    stack = mlp(width, width, layers, 10)
    params = jax.device_get(stack.init(jax.random.key(0)))
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((N, 8, width), dtype=np.float32),
             "y": rng.integers(0, 10, (N, 8), dtype=np.int32)}
    est, opt, out = jg.hybrid(num_exact=SEL, num_tangents=K), optax.adam(1e-3), []
    for update in ("eager", "lazy"):
        cfg = dataclasses.replace(FP32, update=update)

        def timed(store, cfg=cfg):
            ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(*mesh))
            ms = [ex.step(micro, jax.random.key(i)) for i in range(steps + 1)][1:]
            return float(np.median([m["step_time_s"] for m in ms])), int(ms[-1]["layers_read"])

        with tempfile.TemporaryDirectory() as tmp:
            disk = LayerStore.create(Path(tmp) / "s", params, optimizer=opt)
            t_step, reads = timed(disk)
            t_compute, _ = timed(LayerStore.create("memory://", params, optimizer=opt))
            sweeps = reads // layers + (reads % layers > 0)
            order = [l for i in range(sweeps) for l in (range(layers) if i % 2 == 0
                                                        else range(layers - 1, -1, -1))][:reads]
            chunks = [order[i:i + mesh[1]] for i in range(0, len(order), mesh[1])]
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                for _c, _v in Prefetcher(lambda c, disk=disk: [disk.read(l).result() for l in c], chunks,
                                         FP32.prefetch, t0, "read-only"):
                    pass
                for l in range(layers):
                    disk.write(l, disk.read(l).result(), disk.read_opt(l).result())
                disk.commit(disk.step + 1)
                times.append(time.perf_counter() - t0)
            t_read = float(np.median(times))
        hidden = t_compute + t_read - t_step
        out.append({"engine": f"composed {mesh[0]}x{mesh[1]}", "update": update,
                    "layers": layers, "width": width, "layers_read": reads,
                    "step_s": t_step, "compute_only_s": t_compute, "io_only_s": t_read,
                    "efficiency": hidden / min(t_compute, t_read)})
        print(f"  {update}: step {t_step:.3f} s, compute-only {t_compute:.3f} s, I/O-only "
              f"{t_read:.3f} s, efficiency {out[-1]['efficiency']:.2f}", flush=True)
    return out


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
WRITE_LAYERS = 2  # the scale worker's store.max_write_bytes, in layers


def resident_terms(prefetch: int, data: int, stages: int, selected: int, pass_layers: float,
                   opt_leaves: int = 0) -> dict[str, float]:
    """What the composed engine holds for the layers in flight, per process, in layers (one
    layer = its fp32 parameter bytes); see the module docstring. ``pass_layers``: the largest
    pass's temporaries and outputs per device (XLA's memory analysis), in layers. Divided by
    the ``data × stage`` devices it is the resident budget per device."""
    chunks = prefetch + 2  # computing, prefetched, the previous one until its arrays go
    return {"device_copies": data * stages * chunks,
            "host_read_buffers": stages * chunks,
            "pass_buffers": round(data * stages * pass_layers, 2),
            "exact_gradients_on_host": 2 * selected + 1,
            "host_optimizer_update": 3 + 2 * opt_leaves,
            "staged_writes": WRITE_LAYERS}


def _record_pass_buffers(record: dict):
    """Makes the first call of each composed pass record XLA's memory analysis of its
    compiled program (temporaries + outputs per device, bytes) in ``record``; returns the
    function that undoes it."""
    import jaxstream.compose.executor as ce

    orig = ce._circular

    def measured(mesh, stack, spec, name, kw, chains):
        circ = orig(mesh, stack, spec, name, kw, chains)
        win = circ._win

        def call(*args):
            if name not in record:
                ma = getattr(win, "jitted", win).lower(*args).compile().memory_analysis()
                record[name] = int(ma.temp_size_in_bytes + ma.output_size_in_bytes)
            return win(*args)
        circ._win = call
        return circ

    ce._circular = measured

    def undo():  # the cached programs keep the wrapper: after its first call, a plain call
        ce._circular = orig
    return undo


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
    layer_bytes = args.width * args.width * 4 + args.width * 4
    store, stack = sb.build_store(Path(args.dir) / "big", args.width, args.layers,
                                  optimizer=opt, max_write_bytes=WRITE_LAYERS * layer_bytes)
    cfg = dataclasses.replace(FP32, depth=DepthPolicy("progressive", start=2 * s,
                                                      grow=args.layers, every=1))
    ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=mesh)
    passes: dict = {}
    undo = _record_pass_buffers(passes)
    ex.step(batch, jax.random.key(0))
    undo()
    baseline = sb.current_rss()
    reset = sb.reset_peak_rss()
    times, rest = [], []
    for i in range(args.steps):
        m = ex.step(batch, jax.random.key(i + 1))
        # the whole model streamed: forward, reverse (less the resident last chunk), update
        assert m["layers_read"] == 3 * args.layers - s, m
        times.append(m["step_time_s"])
        rest.append(sb.current_rss() - baseline)
    peak = sb.peak_rss_since_reset() if reset else None
    print(json.dumps({"model_bytes": store.layer_bytes * args.layers,
                      "layer_bytes": store.layer_bytes, "baseline_rss_bytes": baseline,
                      "peak_rss_bytes": peak, "peak_reset": reset, "step_s": times,
                      "pass_buffers_bytes_per_device": passes,
                      "rss_after_each_step_above_baseline_bytes": rest}))


def _scale_runs(width: int, layers: int, steps: int, mesh, repeats: int) -> list[dict]:
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, __file__, "--scale-worker", "--dir", tmp, "--width",
                   str(width), "--layers", str(layers), "--steps", str(steps),
                   "--mesh", str(mesh[0]), str(mesh[1])]
            env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_ARENA_MAX="2")
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if out.returncode:
                raise RuntimeError(f"scale worker failed:\n{out.stderr[-4000:]}")
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def scale(width: int, depths=(192, 384), steps: int = 1, mesh=(2, 4), repeats: int = 3) -> dict:
    """The scale measurement at each depth in ``repeats`` fresh processes (the RSS high-water
    mark varies between runs: every run is reported, the largest is compared with the
    budget summed over the devices plus the depth's activation stash)."""
    d, m = mesh
    layer_bytes = width * width * 4 + width * 4
    runs = {layers: _scale_runs(width, layers, steps, mesh, repeats) for layers in depths}
    pass_bytes = max(max(x["pass_buffers_bytes_per_device"].values())
                     for rs in runs.values() for x in rs)
    terms = resident_terms(FP32.prefetch, d, m, SEL, pass_bytes / layer_bytes)
    budget = int(sum(terms.values()) * layer_bytes / (d * m))
    out = []
    for layers, rs in runs.items():
        above = ([x["peak_rss_bytes"] - x["baseline_rss_bytes"] for x in rs]
                 if all(x["peak_reset"] for x in rs) else None)
        stash = layers * SEL * d * width * 4  # (S, B, width) fp32 block inputs per layer
        allowed = budget * d * m + stash
        out.append({"layers": layers, "model_bytes": rs[0]["model_bytes"],
                    "model_over_budget": rs[0]["model_bytes"] / budget,
                    "activation_stash_bytes": stash, "allowed_bytes": allowed,
                    "peak_rss_above_baseline_each_run_bytes": above,
                    "peak_rss_above_baseline_bytes": None if above is None else max(above),
                    "rss_after_each_step_above_baseline_bytes":
                        [x["rss_after_each_step_above_baseline_bytes"] for x in rs],
                    "within_budget": above is not None and max(above) <= allowed,
                    "baseline_rss_bytes": [x["baseline_rss_bytes"] for x in rs],
                    "pass_buffers_bytes_per_device": rs[0]["pass_buffers_bytes_per_device"],
                    "step_s": [x["step_s"] for x in rs]})
    big = out[-1]
    return {"mesh": list(mesh), "width": width, "layer_bytes": layer_bytes,
            "budget_terms_layers": terms, "budget_bytes": budget,
            "budget_summed_over_devices_bytes": budget * d * m, "depths": out,
            "model_over_budget": big["model_over_budget"],
            "within_budget": all(x["within_budget"] for x in out)}


# ---------------------------------------------------------------------------- output
COLS = ("data", "stage", "policy", "estimator", "update", "streamed", "max_rel_err", "ticks",
        "ticks_model", "ticks_chunked", "added_ticks", "fill_ratio", "layers_read",
        "layers_read_model", "layer_reads_per_layer", "bytes_read", "bytes_written",
        "coverage_per_stage", "staleness_per_stage", "step_s", "idle_stall_s",
        "idle_wait_update_s", "idle_wait_write_s")
OVERLAP = ("engine", "overlap_update", "step_s", "step_ratio_to_in_line", "wait_update_s",
           "host_update_s")
EFFICIENCY = ("engine", "update", "layers", "width", "layers_read", "step_s", "compute_only_s",
              "io_only_s", "efficiency")
DEEP = ("selected", "ticks", "ticks_model", "ticks_chunked", "bubble_fraction",
        "bubble_fraction_chunked", "forward_ticks", "forward_bubble_fraction",
        "maxtext_forward_bubble", "layers_read", "executed")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list):
        return " ".join(_fmt(x) for x in v)
    return str(v)


def _table(rows: list[dict], cols) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |\n" for r in rows)


def markdown(rows: list[dict], deep: list[dict], sc: dict,
             overlap: list[dict] | None = None, efficiency: list[dict] | None = None) -> str:
    """The doc block's tables: the streamed rows, the deep hybrid, the overlap and the scale."""
    x = deep[0]
    deep_md = (f"\nThe control-variate hybrid at L = {x['layers']}, M = {x['stages']}, "
               f"N = {x['micro_batches']} for each S (executed on a narrow model; `ticks` and "
               "`bubble_fraction` counted by its passes, `ticks_chunked` and "
               "`bubble_fraction_chunked` the chunked schedule's formula):\n\n"
               + _table(deep, DEEP))
    if overlap:
        deep_md += ("\nThe host optimizer beside the sweeps (`overlap_update`, the default) against "
                    "in line, same run: median step time, its ratio, and the time the step "
                    "waited for the host updates (control-variate hybrid, Adam, 16 layers of "
                    "width 256):\n\n" + _table(overlap, OVERLAP))
    if efficiency:
        deep_md += ("\nOverlap efficiency of a composed step (control-variate hybrid, Adam, full "
                    "size) against its compute-only part (the store in memory) and its "
                    "I/O-only part (the same layer reads, prefetched, and the writes and commit, "
                    "no compute), same run; efficiency = (compute + io − step) / "
                    "min(compute, io), 1 when the shorter part is hidden (reads from the page "
                    "cache):\n\n"
                    + _table(efficiency, EFFICIENCY))
    mib = lambda x: round(x / MiB, 2)
    s = (f"\nscale (mesh {sc['mesh'][0]} × {sc['mesh'][1]}, width {sc['width']}): resident "
         f"budget {sc['budget_bytes'] / MiB:.2f} MiB per device "
         f"({sum(sc['budget_terms_layers'].values()):.1f} layers per process: "
         + ", ".join(f"{k} {v}" for k, v in sc["budget_terms_layers"].items())
         + f"), {sc['budget_summed_over_devices_bytes'] / MiB:.2f} MiB summed over the "
         "devices.\n")
    for x in sc["depths"]:
        s += (f"- {x['layers']} layers: model {x['model_bytes'] / MiB:.1f} MiB = "
              f"{x['model_over_budget']:.1f} × the budget per device; peak RSS above the "
              f"constant {_fmt([mib(v) for v in x['peak_rss_above_baseline_each_run_bytes'] or []])}"
              f" MiB in fresh processes against {x['allowed_bytes'] / MiB:.2f} MiB (the budget "
              f"summed over the devices + the activation stash "
              f"{x['activation_stash_bytes'] / MiB:.2f} MiB; constant "
              f"{_fmt([round(v / MiB) for v in x['baseline_rss_bytes']])} MiB)\n")
    return _table(rows, COLS) + deep_md + s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer meshes and estimators")
    ap.add_argument("--json", type=Path, help="write {rows, scale} here")
    ap.add_argument("--doc", type=Path, help="rewrite the table block of this markdown file")
    ap.add_argument("--doc-from", type=Path, metavar="JSON",
                    help="with --doc: write the block from a run's --json output, running nothing")
    ap.add_argument("--scale-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--mesh", type=int, nargs=2, default=(2, 4), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scale_worker:
        scale_worker(args)
        return 0
    if args.doc_from:
        if not args.doc:
            ap.error("--doc-from needs --doc")
        run = json.loads(args.doc_from.read_text())
        write_tables(args.doc, "composed.py",
                     {"table": markdown(run["rows"], run["deep"], run["scale"], run.get("overlap"),
                                        run.get("efficiency"))},
                     f"{run['command']} --json {args.doc_from.name}",
                     where=run["machine"] + (f" ({run['cpus']} CPU cores, simulated devices)"
                                             if run.get("cpus") else ""))
        print(f"wrote {args.doc} from {args.doc_from}")
        return 0
    layers = 8
    if args.quick:
        meshes, names = ((1, 4), (2, 4)), ("forward", "backprop", "hybrid_cv", "hybrid_weighted",
                                          "hybrid_guess", "activity")
    else:
        meshes, names = ((1, 4), (2, 4), (2, 2), (4, 2)), tuple(ESTIMATORS)
    print("streamed (composed engine):", flush=True)
    rows = streamed_rows(meshes, layers, names)
    print("deep (L = 64, M = 8, N = 16, control variate):", flush=True)
    deep = deep_rows()
    print("host update beside the sweeps, against in line:", flush=True)
    overlap = overlap_rows()
    print("overlap efficiency (compute-only, read-only):", flush=True)
    efficiency = overlap_efficiency()
    print("in-memory pipeline (stage axis):", flush=True)
    rows += in_memory_rows(4, layers, args.quick)
    print("scale:", flush=True)
    sc = scale(128, (192, 384), 1, repeats=2) if args.quick else scale(256, (192, 384), 2)
    for r in rows:
        print("  ".join(f"{c}={_fmt(r.get(c))}" for c in COLS))
    print(json.dumps(sc, indent=1))
    command = "python benchmarks/composed.py" + (" --quick" if args.quick else "")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "deep": deep, "overlap": overlap,
                                         "efficiency": efficiency,
                                         "scale": sc,
                                         "command": command,
                                         "machine": machine()},
                                        indent=1))
        print(f"wrote {args.json}")
    if args.doc:
        write_tables(args.doc, "composed.py",
                     {"table": markdown(rows, deep, sc, overlap, efficiency)},
                     command + f" --doc {args.doc}")
        print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
