"""Layer-streaming benchmark: store reads vs raw reads, overlap, scale, equality, crashes.

    python benchmarks/streaming.py --quick --json out.json     # small sizes, < 2 minutes
    python benchmarks/streaming.py --crash-kills 10            # full sizes + 10 SIGKILL runs

(a) read: cold reads (page cache evicted with posix_fadvise DONTNEED before every pass) of
    every layer through the LayerStore (prefetching) against a raw sequential read of the
    same chunk files, same run. (b) overlap: max(compute-only with the layers resident,
    read-only) / streamed step, at the batch the planner picks for compute ~ read; the
    planner's predicted step time is printed beside the measurement. (c) scale: in a fresh
    subprocess, a model >= 8x a resident budget is created layer by layer and stream-trained
    for a few steps; peak RSS (getrusage) minus the process's baseline (imports, runtime,
    compiled kernels: the stated constant) is compared with the budget. Also: the max
    relative error of streamed gradients against the in-memory estimators (fp32), and the
    SIGKILL crash experiment.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream import kernels as K
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from jaxstream.stream.planner import LayerCost, plan
from jaxstream.stream.prefetch import Prefetcher

MiB = 1 << 20


def evict(directory: Path) -> None:
    """Drops the page cache of every file under ``directory``."""
    for root, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def build_store(path: Path, width: int, layers: int, in_dim: int = 64, optimizer=None,
                seed: int = 0, max_write_bytes: int = 256 * MiB) -> tuple[LayerStore, object]:
    """A store of an MLP written layer by layer (the whole model is never in memory)."""
    stack = mlp(in_dim, width, layers, 10)
    shapes = jax.eval_shape(stack.init, jax.random.key(0))
    store = LayerStore.create(path, shapes, optimizer=optimizer, model_config={"width": width})
    store.max_write_bytes = max_write_bytes
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(width)
    for l in range(layers):
        store.write(l, {"linear": {"bias": rng.standard_normal(width, np.float32) * 0.01,
                                   "kernel": (rng.standard_normal((width, width), np.float32) * scale)}})
    small = mlp(in_dim, width, 1, 10).init(jax.random.key(seed))  # embed/head only
    store.write("embed", jax.device_get(small["embed"]))
    store.write("head", jax.device_get(small["head"]))
    store.commit(0)
    return store, stack


def chunk_files(path: Path, store: LayerStore) -> list[Path]:
    """The block chunk files the store reads, in layer order (committed slots only)."""
    slots = store._m["slots"]["blocks"]
    files = []
    for l in range(store.num_layers):
        for leaf in sorted((path / "params" / "blocks").iterdir()):
            f = leaf / "c" / str(l) / str(slots[l])
            files += sorted(p for p in f.rglob("*") if p.is_file())
    return files


def bench_read(path: Path, store: LayerStore, passes: int) -> dict:
    files = chunk_files(path, store)
    nbytes = sum(f.stat().st_size for f in files)
    raw, ts_ = [], []
    for _ in range(passes):
        evict(path)
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.read(16 * MiB):
                    pass
        raw.append(time.perf_counter() - t0)
        evict(path)
        t0 = time.perf_counter()
        got = 0
        for _, layer in Prefetcher(lambda l: store.read(l).result(), range(store.num_layers), 4):
            got += sum(a.nbytes for a in jax.tree.leaves(layer))
        ts_.append(time.perf_counter() - t0)
        assert got == nbytes, (got, nbytes)
    raw_bw, store_bw = nbytes / min(raw), nbytes / min(ts_)
    return {"bytes": nbytes, "raw_GBps": raw_bw / 1e9, "store_GBps": store_bw / 1e9,
            "read_ratio": store_bw / raw_bw}


def bench_overlap(path: Path, store: LayerStore, stack, passes: int) -> dict:
    """Compute-only, read-only and streamed forward sweeps (cold reads, fp32 compute)."""
    est = jg.forward(num_tangents=1)
    cfg = StreamConfig(prefetch=2, compute_dtype="float32")
    ex = StreamedExecutor(stack, est, optax.sgd(0.0), store, cfg)
    key = jax.random.key(0)
    L = store.num_layers
    layers_dev = [ex._to_device(store.read(l).result()) for l in range(L)]

    def compute_only(b):
        h = jnp.ones((1, b, stack_width(store)), jnp.float32)
        dh = jnp.ones((1, 1, b, stack_width(store)), jnp.float32)
        keys = key[None]
        h2, _ = K.block_jvp(stack, est.spec, layers_dev[0], jnp.int32(0), keys, h, dh)
        h2.block_until_ready()
        t0 = time.perf_counter()
        for l in range(L):
            h, dh = K.block_jvp(stack, est.spec, layers_dev[l], jnp.int32(l), keys, h, dh)
            h.block_until_ready()
        return time.perf_counter() - t0

    def read_only():
        evict(path)
        t0 = time.perf_counter()
        for _ in Prefetcher(lambda l: ex._to_device(store.read(l).result()), range(L), 2):
            pass
        return time.perf_counter() - t0

    t_read = min(read_only() for _ in range(passes))
    # compute time is a + c·b (tangent generation per parameter + per-sample work): fit it
    # on two batches and pick the batch at which compute ~ read (the smallest, if compute
    # already exceeds the read at any batch)
    b0, b1 = 16, 128
    t0_, t1_ = (min(compute_only(b) for _ in range(2)) for b in (b0, b1))
    slope = max((t1_ - t0_) / (b1 - b0), 1e-9)
    b = int(min(4096, max(b0, (t_read - (t0_ - slope * b0)) / slope)))
    t_comp = min(compute_only(b) for _ in range(passes))
    layers_dev.clear()  # free the resident copies before streaming
    x = np.random.default_rng(0).standard_normal((1, b, 64)).astype(np.float32)
    batch = {"x": x, "y": np.zeros((1, b), np.int32)}
    ex.forward(batch, key)  # compile embed/head
    streamed, stalls = [], []
    for _ in range(passes):
        evict(path)
        ex.events = []
        t0 = time.perf_counter()
        ex.forward(batch, key)
        streamed.append(time.perf_counter() - t0)
        stalls.append(sum(e.stall for e in ex.events))
    t_stream = min(streamed)
    cost = LayerCost(store.layer_bytes, 6.0 * stack_width(store) ** 2, 0, L)
    flops_rate = cost.flops_per_sample * b * L / t_comp
    pred = plan(cost, device_flops=flops_rate, read_bandwidth=store.layer_bytes * L / t_read,
                device_memory=64e9, prefetch=2, compute_bytes=4, batch=b)
    return {"batch": b, "compute_only_s": t_comp, "read_only_s": t_read, "streamed_s": t_stream,
            "overlap_efficiency": max(t_comp, t_read) / t_stream,
            "stall_s": float(np.median(stalls)), "planner_min_batch": pred.min_batch,
            "planner_step_s": pred.step_time}


def stack_width(store: LayerStore) -> int:
    return int(store.model_config["width"])


def bench_equality(quick: bool) -> float:
    """Max relative error (‖a−b‖∞/‖b‖∞ per leaf) of streamed vs in-memory gradients, fp32."""
    stack = mlp(8, 16, 4, 3)
    params = stack.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 5, 8))
    y = jax.random.randint(jax.random.key(2), (4, 5), 0, 3)
    micro, flat = {"x": x, "y": y}, {"x": x.reshape(20, 8), "y": y.reshape(20)}
    worst = 0.0
    with tempfile.TemporaryDirectory() as d:
        for i, (est, batch) in enumerate([(jg.backprop(), flat), (jg.forward(num_tangents=4), flat),
                                          (jg.hybrid(num_exact=2, num_tangents=2), micro),
                                          (jg.hybrid(num_exact=1, correction="replace"), micro)
                                          ][: 3 if quick else 4]):
            store = LayerStore.create(Path(d) / str(i), params)
            ex = StreamedExecutor(stack, est, optax.sgd(0.1), store, StreamConfig(compute_dtype="float32"))
            key = jax.random.key(9)
            _, g = ex.estimate(micro, key)
            _, ref = jax.jit(est, static_argnums=0)(stack, params, batch, key)
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
                b = np.asarray(b, np.float64)
                worst = max(worst, float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b))))
    return worst


def current_rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_since_reset() -> int:
    """VmHWM: the RSS high-water mark since :func:`reset_peak_rss`."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    """Resets the kernel's RSS high-water mark (what getrusage's ru_maxrss reports)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def scale_worker(args) -> None:
    """Runs in a fresh process: build the large store layer by layer, run one step (runtime
    start-up and kernel compilation: part of the constant), then measure the RSS high-water
    mark over the following streamed steps."""
    batch = {"x": np.zeros((1, 32, 64), np.float32), "y": np.zeros((1, 32), np.int32)}
    cfg = StreamConfig(prefetch=2, compute_dtype="bfloat16", update="lazy")
    store, stack = build_store(Path(args.dir) / "big", args.width, args.layers,
                               optimizer=optax.sgd(1e-3), max_write_bytes=args.budget // 8)
    ex = StreamedExecutor(stack, jg.forward(), optax.sgd(1e-3), store, cfg)
    ex.step(batch, jax.random.key(100))
    ex.step(batch, jax.random.key(101))  # the second step compiles the lazy-update path
    baseline = current_rss()
    reset = reset_peak_rss()
    times, stalls = [], []
    for s in range(args.steps):
        m = ex.step(batch, jax.random.key(s))
        times.append(m["step_time_s"])
        stalls.append(m["stall_s"])
    ex.flush()
    lifetime_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = peak_rss_since_reset() if reset else lifetime_peak
    dev = jax.devices()[0].memory_stats() or {}
    print(json.dumps({"model_bytes": store.layer_bytes * args.layers, "baseline_rss_bytes": baseline,
                      "peak_reset": reset, "lifetime_peak_rss_bytes": lifetime_peak,
                      "peak_rss_bytes": peak, "step_s": times, "stall_s": stalls,
                      "device_peak_bytes": dev.get("peak_bytes_in_use")}))


def bench_scale(workdir: Path, width: int, layers: int, steps: int, budget: int) -> dict:
    cmd = [sys.executable, __file__, "--scale-worker", "--dir", str(workdir), "--width", str(width),
           "--layers", str(layers), "--steps", str(steps), "--budget", str(budget)]
    # glibc keeps freed layer buffers in per-thread arenas unless told to mmap large blocks
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_ARENA_MAX="2")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (< 2 minutes)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--crash-kills", type=int, default=0, help="SIGKILL crash runs (0: skip)")
    ap.add_argument("--scale-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scale_worker:
        return scale_worker(args)
    q = args.quick
    read_w, read_l = (1024, 16) if q else (2048, 64)          # 64 MiB / 1 GiB
    scale_w, scale_l, budget = (512, 128, 16 * MiB) if q else (1448, 256, 256 * MiB)  # 8x
    work = Path(tempfile.mkdtemp(prefix="jaxstream-bench-", dir=args.dir))
    try:
        store, stack = build_store(work / "read", read_w, read_l)
        res = {"mode": "quick" if q else "full"}
        res["read"] = bench_read(work / "read", store, passes=2 if q else 3)
        res["overlap"] = bench_overlap(work / "read", store, stack, passes=2 if q else 3)
        shutil.rmtree(work / "read")
        res["max_rel_err"] = bench_equality(q)
        res["scale"] = bench_scale(work / "scale", scale_w, scale_l, 2, budget)
        shutil.rmtree(work / "scale", ignore_errors=True)
        if args.crash_kills:
            from jaxstream.stream.crash import run_crash_experiment

            crash = run_crash_experiment(kills=args.crash_kills, steps=12, workdir=str(work))
            shutil.rmtree(crash.pop("workdir"), ignore_errors=True)
            res["crash"] = crash
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sc = res["scale"]
    out = {"read_ratio": res["read"]["read_ratio"],
           "overlap_efficiency": res["overlap"]["overlap_efficiency"],
           "max_rel_err": res["max_rel_err"], "model_bytes": sc["model_bytes"],
           "budget_bytes": budget, "peak_rss_bytes": sc["peak_rss_bytes"],
           "baseline_rss_bytes": sc["baseline_rss_bytes"],
           "rss_above_baseline_bytes": sc["peak_rss_bytes"] - sc["baseline_rss_bytes"],
           "details": res}
    r, o = res["read"], res["overlap"]
    rows = [
        ("(a) raw sequential read, cold", f"{r['raw_GBps']:.3f} GB/s", f"{r['bytes'] / MiB:.0f} MiB"),
        ("(a) LayerStore read, cold", f"{r['store_GBps']:.3f} GB/s", f"ratio {r['read_ratio']:.3f}"),
        ("(b) compute only (resident)", f"{o['compute_only_s'] * 1e3:.1f} ms", f"batch {o['batch']}"),
        ("(b) read only", f"{o['read_only_s'] * 1e3:.1f} ms", ""),
        ("(b) streamed forward sweep", f"{o['streamed_s'] * 1e3:.1f} ms",
         f"efficiency {o['overlap_efficiency']:.3f}, stall {o['stall_s'] * 1e3:.1f} ms"),
        ("(b) planner prediction", f"{o['planner_step_s'] * 1e3:.1f} ms", f"min batch {o['planner_min_batch']}"),
        ("(c) model / budget", f"{sc['model_bytes'] / MiB:.0f} MiB", f"{budget / MiB:.0f} MiB"),
        ("(c) peak RSS - constant", f"{out['rss_above_baseline_bytes'] / MiB:.0f} MiB",
         f"constant {sc['baseline_rss_bytes'] / MiB:.0f} MiB, step {np.mean(sc['step_s']):.2f} s"),
        ("streamed vs in-memory grads", f"max rel err {res['max_rel_err']:.2e}", "fp32"),
    ]
    if "crash" in res:
        c = res["crash"]
        rows.append(("SIGKILL crash runs", f"{c['kills']} kills",
                     f"opened at commit: {c['opened_at_committed_step']}, resumed equal: {c['resumed_equal']}"))
    for a, b, c in rows:
        print(f"{a:<32} {b:>22}   {c}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
