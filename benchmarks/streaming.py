"""Layer-streaming benchmark: store reads vs raw reads, overlap, layout, scale, equality, crashes.

    python benchmarks/streaming.py --quick --json out.json     # small sizes, < 2 minutes
    python benchmarks/streaming.py --crash-kills 10            # full sizes + 10 SIGKILL runs

(a) read: cold reads (page cache evicted with posix_fadvise DONTNEED before every pass) of
    every layer through the LayerStore (prefetching) against a raw sequential read of the
    same chunk files, same run. (b) overlap: max(compute-only with the layers resident,
    read-only) / streamed forward sweep, at the batch where compute ~ read, all cold. Measured
    in a fresh process whose XLA runs on one thread (``ONE_XLA_THREAD_ENV``; on the CPU backend
    compute and reads share the cores, and a multi-threaded XLA computation stalls whenever
    a read takes one of its cores), in interleaved rounds (median times), with process CPU
    time per sweep, stalls and the prefetch timeline; full mode also measures the default
    XLA threading in this process. The planner's predicted step time is printed beside it.
    Layout: cold layer-by-layer reads of the same bytes stored as one zarr3 array per leaf
    (layer axis chunked per layer: the store's layout) and as one array per layer per leaf.
    (c) scale: in a fresh subprocess, a model >= 8x a resident budget is created layer by
    layer and stream-trained for a few steps; peak RSS minus the process's baseline
    (imports, runtime, compiled kernels: the stated constant) is compared with the budget;
    it runs beside the equality check (it measures memory, not time). Also: the max relative
    error of streamed gradients against the in-memory estimators (fp32), and the SIGKILL
    crash experiment.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ONE_XLA_THREAD_ENV = "JAXSTREAM_BENCH_ONE_XLA_THREAD"
if os.environ.get(ONE_XLA_THREAD_ENV) == "1":
    # XLA's CPU client sizes its intra-op pool (threads "tf_XLAEigen") from the CPU affinity
    # when the client is created; XLA_FLAGS "--xla_cpu_multi_thread_eigen=false
    # intra_op_parallelism_threads=1" leave it at one thread per core with jax 0.10. So:
    # create the client on one core, then give every thread all cores back (reads, Python).
    _cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(_cpus)})
    import jax

    jax.devices()
    for _tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(_tid), _cpus)
        except OSError:
            pass

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

sys.path.insert(0, str(Path(__file__).parent))
import thread_time

MiB = 1 << 20
CRC_BYTES = 4  # the zarr3 crc32c codec's checksum at the end of every chunk file


def evict(directory: Path) -> None:
    """Drops the page cache of every file under ``directory``."""
    for root, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def mlp_stack(in_dim: int, width: int, layers: int):
    """The benchmark MLP's functions with ``layers`` blocks, built from a one-block ``mlp``.

    ``mlp(in_dim, width, layers, 10)`` initialises every layer when it is built (the whole
    model in memory, seconds per GiB); here the store holds the weights, so one block is
    built and the depth set. Its ``init`` returns one block (embed/head are the same).
    """
    return dataclasses.replace(mlp(in_dim, width, 1, 10), num_layers=layers)


def build_store(path: Path, width: int, layers: int, in_dim: int = 64, optimizer=None,
                seed: int = 0, max_write_bytes: int = 256 * MiB) -> tuple[LayerStore, object]:
    """A store of an MLP written layer by layer (the whole model is never in memory)."""
    stack = mlp_stack(in_dim, width, layers)
    one = jax.eval_shape(stack.init, jax.random.key(0))
    stacked = lambda a: jax.ShapeDtypeStruct((layers,) + a.shape[1:], a.dtype)
    shapes = {**one, "blocks": jax.tree.map(stacked, one["blocks"])}
    store = LayerStore.create(path, shapes, optimizer=optimizer, model_config={"width": width})
    store.max_write_bytes = max_write_bytes
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(width)
    for l in range(layers):
        store.write(l, {"linear": {"bias": rng.standard_normal(width, np.float32) * 0.01,
                                   "kernel": (rng.standard_normal((width, width), np.float32) * scale)}})
    small = stack.init(jax.random.key(seed))  # embed/head (and one block, unused)
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
        assert got == nbytes - CRC_BYTES * len(files), (got, nbytes, len(files))
    raw_bw, store_bw = nbytes / min(raw), nbytes / min(ts_)
    return {"bytes": nbytes, "raw_GBps": raw_bw / 1e9, "store_GBps": store_bw / 1e9,
            "read_ratio": store_bw / raw_bw, "read_ratio_median": float(np.median(raw) / np.median(ts_)),
            "raw_s": raw, "store_s": ts_}


def xla_threads() -> int:
    """Threads of XLA's CPU intra-op pool in this process."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                n += "XLAEigen" in fh.read()
        except OSError:
            pass
    return n


def bench_overlap(path: Path, store: LayerStore, stack, rounds: int, prefetch: int = 2,
                  pin_compute: bool = False) -> dict:
    """Compute-only, read-only and streamed forward sweeps (cold reads, fp32 compute).

    The batch is sized so that compute ~ read (compute per layer, measured on the first layers
    at batches growing 4x, interpolated). Then ``rounds`` rounds each run the three sweeps
    (order rotated, so load drifts on a shared machine hit all three alike); the efficiency
    is max(median compute-only, median read-only) / median streamed. Process CPU time of each
    sweep is recorded: on a CPU backend reads and compute share the cores, so a streamed
    sweep cannot beat (compute CPU + read CPU) / cores available. Per sweep, the thread
    that runs XLA's computation is split into run / run-queue wait / idle time, beside the
    dispatching thread's and the other threads' (reads) time (:mod:`thread_time`).

    ``pin_compute``: after the batch is sized, XLA's compute thread gets the first core
    alone and every other thread the other cores (for all three sweeps alike). On a CPU
    backend this stands in for a compute device of its own, the case streaming is for:
    reads, Python and the disk's interrupts then never take the compute's core.
    """
    est = jg.forward(num_tangents=1)
    cfg = StreamConfig(prefetch=prefetch, compute_dtype="float32")
    ex = StreamedExecutor(stack, est, optax.sgd(0.0), store, cfg)
    key = jax.random.key(0)
    L, W = store.num_layers, stack_width(store)
    load0 = os.getloadavg()[0]
    layers_dev = [ex._to_device(store.read(l).result()) for l in range(L)]

    def compute_only(b, n=L):
        h = jax.device_put(np.ones((1, b, W), np.float32))  # (no compile per batch size)
        dh = jax.device_put(np.ones((1, 1, b, W), np.float32))
        keys = key[None]
        h2, _ = K.block_jvp(stack, est.spec, layers_dev[0], jnp.int32(0), keys, h, dh)  # warm
        h2.block_until_ready()
        t0, c0 = time.perf_counter(), time.process_time()
        for l in range(n):  # as the executor: each block waits for the one before it
            h_in = h
            h, dh = K.block_jvp(stack, est.spec, layers_dev[l], np.int32(l), keys, h, dh)
            h_in.block_until_ready()
        h.block_until_ready()
        return time.perf_counter() - t0, time.process_time() - c0

    def read_only():
        evict(path)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in Prefetcher(lambda l: ex._to_device(store.read(l).result()), range(L), prefetch):
            pass
        return time.perf_counter() - t0, time.process_time() - c0

    # the batch at which compute ~ read: compute per layer (median of 3, first layers) on
    # batches growing 4x until it reaches the read time per layer, then interpolated
    t_r = float(np.median([read_only()[0] for _ in range(2)])) / L
    n_fit = min(L, 8)
    t_c = lambda b: float(np.median([compute_only(b, n_fit)[0] for _ in range(3)])) / n_fit
    lo, t_lo = 4, t_c(4)
    b = lo
    if t_lo < t_r:
        while lo < 4096:
            hi, t_hi = 4 * lo, t_c(4 * lo)
            if t_hi >= t_r:
                b = lo + round((hi - lo) * (t_r - t_lo) / max(t_hi - t_lo, 1e-9))
                break
            lo, t_lo, b = hi, t_hi, hi
    b = int(min(4096, max(1, b)))

    x = np.random.default_rng(0).standard_normal((1, b, 64)).astype(np.float32)
    batch = {"x": x, "y": np.zeros((1, b), np.int32)}
    ex.forward(batch, key)  # compile embed/head

    def streamed():
        evict(path)
        ex.events = []
        t0, c0 = time.perf_counter(), time.process_time()
        ex.forward(batch, key)
        return time.perf_counter() - t0, time.process_time() - c0, list(ex.events)

    main = threading.main_thread().native_id
    compute_only(b, 1)  # compiles for this batch
    hot = thread_time.busiest(lambda: compute_only(b, n_fit), {main})
    cpus = sorted(os.sched_getaffinity(0))
    pinned = bool(pin_compute and hot is not None and len(cpus) > 1
                  and thread_time.pin(hot, cpus[0], set(cpus[1:])))

    def accounted(fn):
        a = thread_time.snapshot()
        v = fn()
        return (*v, thread_time.split(a, thread_time.snapshot(), v[0], hot, main, v[1]))

    fns = {"compute": lambda: compute_only(b), "read": read_only, "streamed": streamed}
    runs: dict = {k: [] for k in fns}
    order = list(fns)
    for r in range(rounds):
        for k in order[r % 3:] + order[: r % 3]:
            runs[k].append(accounted(fns[k]))
    med = lambda k, i=0: float(np.median([v[i] for v in runs[k]]))
    t_comp, t_read, t_stream = med("compute"), med("read"), med("streamed")
    per_round = [max(c[0], r[0]) / s[0]
                 for c, r, s in zip(runs["compute"], runs["read"], runs["streamed"])]
    best = {k: min(v[0] for v in runs[k]) for k in runs}
    stalls = [sum(e.stall for e in s[2]) for s in runs["streamed"]]
    fill = [sum(e.stall for e in s[2][:2]) for s in runs["streamed"]]  # embed + first layer
    # the timeline of the median streamed sweep: are loads issued p layers ahead, in time?
    ev = sorted(runs["streamed"], key=lambda v: v[0])[len(runs["streamed"]) // 2][2]
    threads = {k: {f: float(np.median([v[-1][f] for v in runs[k]])) for f in runs[k][0][-1]}
               for k in runs}
    blocks = [e for e in ev if e.unit.is_block]
    # loads of later layers started while layer l computed (p expected: l+1 .. l+p)
    pairs = list(itertools.pairwise(blocks))[: max(0, len(blocks) - max(prefetch, 1))]
    ahead = [sum(1 for f in blocks if f.unit.layers > e.unit.layers
                 and f.load_start < n.compute_start - n.stall)
             for e, n in pairs]
    timeline = {
        "loads_started_during_compute_median": float(np.median(ahead)) if ahead else 0.0,
        "layers_ready_before_compute": (sum(e.stall < 5e-4 for e in blocks[1:])
                                        / max(1, len(blocks) - 1)),
        "ready_slack_ms_median": 1e3 * float(np.median([e.compute_start - e.load_end
                                                        for e in blocks[1:]] or [0])),
        "events_ms": [[str(e.unit), *(round(1e3 * t, 2)
                                 for t in (e.load_start, e.load_end, e.compute_start, e.stall))]
                      for e in ev],
    }
    cost = LayerCost(store.layer_bytes, 6.0 * W ** 2, 0, L)
    pred = plan(cost, device_flops=cost.flops_per_sample * b * L / t_comp,
                read_bandwidth=store.layer_bytes * L / t_read, device_memory=64e9,
                prefetch=prefetch, compute_bytes=4, batch=b)
    config = {"xla_intra_op_threads": xla_threads(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "cpu_count": os.cpu_count(), "width": W, "layers": L,
              "layer_bytes": store.layer_bytes, "batch": b, "prefetch": prefetch,
              "compute_dtype": "float32", "estimator": "forward, K=1 (one jvp sweep)",
              "compute_thread_pinned": pinned,
              "rounds": rounds, "estimator_of_times": "median over rounds",
              "loadavg_1min": [load0, os.getloadavg()[0]]}
    return {
        "config": config, "batch": b,
        "compute_only_s": t_comp, "read_only_s": t_read, "streamed_s": t_stream,
        "overlap_efficiency": max(t_comp, t_read) / t_stream,
        "overlap_efficiency_per_round_median": float(np.median(per_round)),
        "overlap_efficiency_min_based": max(best["compute"], best["read"]) / best["streamed"],
        "stall_s": float(np.median(stalls)), "fill_stall_s": float(np.median(fill)),
        "cpu_s": {k: med(k, 1) for k in runs},
        # cores the process got (CPU time / wall time): the streamed sweep needs about
        # cpu compute + cpu read, so on a shared machine it cannot be shorter than that / cores
        "cores_used": {k: float(np.median([v[1] / v[0] for v in runs[k]])) for k in runs},
        "timeline": timeline,
        # medians per sweep: the compute thread's run / run-queue wait / idle, main, others
        "threads_s": threads,
        "planner_min_batch": pred.min_batch, "planner_step_s": pred.step_time,
    }


def overlap_worker(args) -> None:
    """Runs :func:`bench_overlap` on an existing store in a fresh process (its XLA threads)."""
    stack = mlp_stack(64, args.width, args.layers)
    store = LayerStore.open(Path(args.dir))
    print(json.dumps(bench_overlap(Path(args.dir), store, stack, args.steps, pin_compute=args.pin)))


def bench_overlap_subprocess(path: Path, width: int, layers: int, rounds: int,
                             pin: bool = False) -> dict:
    """:func:`bench_overlap` in a fresh process whose XLA CPU client has one intra-op thread
    (``pin``: on a core of its own)."""
    cmd = [sys.executable, __file__, "--overlap-worker", "--dir", str(path), "--width", str(width),
           "--layers", str(layers), "--steps", str(rounds)] + (["--pin"] if pin else [])
    env = dict(os.environ, **{ONE_XLA_THREAD_ENV: "1"})
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"overlap worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_layout(work: Path, store: LayerStore, passes: int) -> dict:
    """Cold reads of the same bytes in the two layouts the design chose between.

    per_leaf: one zarr3 array per parameter leaf, shape (L, *leaf), one chunk per layer (the
    store's layout, without its slot axis); per_layer: one zarr3 array per layer per leaf,
    one chunk. Same context, same reads (each layer's leaves read concurrently into aligned
    arrays), arrays opened beforehand (as a store does at open; the open time is reported).
    Read layer by layer without prefetch (``p0``: per-layer latency shows) and with the
    executor's prefetch of 2 layers; passes alternate the two layouts; median times.
    """
    from jaxstream.stream.layout import make_context, open_array, open_kvstore
    from jaxstream.stream.store_parts import ReadInto

    ctx = make_context(file_io_sync=False)
    L = store.num_layers
    table = store._m["leaves"]["params"]["blocks"]
    roots = {"per_leaf": work / "per_leaf", "per_layer": work / "per_layer"}
    kv = {k: open_kvstore(v, ctx) for k, v in roots.items()}
    for i, e in enumerate(table):
        s = tuple(e["shape"])
        open_array(kv["per_leaf"], f"{i}.{e['name']}", ctx, create=True, shape=(L,) + s,
                   chunk=(1,) + s, dtype=e["dtype"])
        for l in range(L):
            open_array(kv["per_layer"], f"{l}/{i}.{e['name']}", ctx, create=True, shape=s,
                       chunk=s, dtype=e["dtype"])
    opened, open_s = {}, {}
    t0 = time.perf_counter()
    opened["per_leaf"] = [open_array(kv["per_leaf"], f"{i}.{e['name']}", ctx)
                          for i, e in enumerate(table)]
    open_s["per_leaf"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    opened["per_layer"] = [[open_array(kv["per_layer"], f"{l}/{i}.{e['name']}", ctx)
                            for i, e in enumerate(table)] for l in range(L)]
    open_s["per_layer"] = time.perf_counter() - t0
    nbytes = 0
    for l in range(L):
        leaves = jax.tree_util.tree_leaves(store.read(l).result())
        nbytes += sum(x.nbytes for x in leaves)
        futs = [opened["per_leaf"][i][l].write(x) for i, x in enumerate(leaves)]
        futs += [opened["per_layer"][l][i].write(x) for i, x in enumerate(leaves)]
        for f in futs:
            f.result()
    views = {"per_leaf": lambda l: [a[l] for a in opened["per_leaf"]],
             "per_layer": lambda l: opened["per_layer"][l]}

    def one_pass(kind, depth):
        load = lambda l: [r.result() for r in [ReadInto(v) for v in views[kind](l)]]
        evict(roots[kind])
        t0 = time.perf_counter()
        got = 0
        for _, leaves in Prefetcher(load, range(L), depth):
            got += sum(x.nbytes for x in leaves)
        assert got == nbytes, (got, nbytes)
        return time.perf_counter() - t0

    out: dict = {"bytes": nbytes, "layers": L, "leaves_per_layer": len(table),
                 "files": {"per_leaf": len(table), "per_layer": L * len(table)}, "open_s": open_s}
    for depth in (0, 2):
        times: dict = {"per_leaf": [], "per_layer": []}
        for p in range(passes):
            for kind in (("per_leaf", "per_layer") if p % 2 == 0 else ("per_layer", "per_leaf")):
                times[kind].append(one_pass(kind, depth))
        mbps = {k: nbytes / 1e6 / float(np.median(v)) for k, v in times.items()}
        out[f"p{depth}"] = {"per_leaf_MBps": mbps["per_leaf"], "per_layer_MBps": mbps["per_layer"],
                            "ratio": mbps["per_leaf"] / mbps["per_layer"]}
    out.update(out["p0"])  # headline: layer by layer, no prefetch
    out["ratio_meaning"] = "per_leaf_MBps / per_layer_MBps (> 1: the store's layout reads faster)"
    for k in roots.values():
        shutil.rmtree(k, ignore_errors=True)
    return out


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


def start_scale(workdir: Path, width: int, layers: int, steps: int, budget: int) -> subprocess.Popen:
    """Starts the scale worker (it only measures memory, so it may run beside other work)."""
    cmd = [sys.executable, __file__, "--scale-worker", "--dir", str(workdir), "--width", str(width),
           "--layers", str(layers), "--steps", str(steps), "--budget", str(budget)]
    # glibc keeps freed layer buffers in per-thread arenas unless told to mmap large blocks
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_ARENA_MAX="2")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish_scale(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"scale worker failed:\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def overlap_rows(name: str, o: dict) -> list[tuple[str, str, str]]:
    """The table rows of one overlap measurement."""
    c = o["cpu_s"]
    return [
        (f"(b) {name}: compute only", f"{o['compute_only_s'] * 1e3:.1f} ms",
         f"batch {o['batch']}, cpu {c['compute'] * 1e3:.0f} ms"),
        (f"(b) {name}: read only", f"{o['read_only_s'] * 1e3:.1f} ms", f"cpu {c['read'] * 1e3:.0f} ms"),
        (f"(b) {name}: streamed", f"{o['streamed_s'] * 1e3:.1f} ms",
         (f"efficiency {o['overlap_efficiency']:.3f}, stall {o['stall_s'] * 1e3:.1f} ms "
          f"(fill {o['fill_stall_s'] * 1e3:.1f}), cpu {c['streamed'] * 1e3:.0f} ms")),
    ] + [(f"(b) {name}: {k} threads", f"{t['compute_run_s'] * 1e3:.1f} ms",
          (f"compute thread run (wait {t['compute_wait_s'] * 1e3:.1f}, idle "
           f"{t['compute_idle_s'] * 1e3:.1f}); main {t['main_run_s'] * 1e3:.1f} (wait "
           f"{t['main_wait_s'] * 1e3:.1f}); others {t['other_run_s'] * 1e3:.1f} (wait "
           f"{t['other_wait_s'] * 1e3:.1f})"))
         for k, t in o.get("threads_s", {}).items()]


def read_rows(r: dict) -> list[tuple[str, str, str]]:
    """The table rows of the read measurement."""
    return [
        ("(a) raw sequential read, cold", f"{r['raw_GBps']:.3f} GB/s", f"{r['bytes'] / MiB:.0f} MiB"),
        ("(a) LayerStore read, cold", f"{r['store_GBps']:.3f} GB/s",
         f"ratio {r['read_ratio']:.3f} (medians: {r['read_ratio_median']:.3f})"),
    ]


def overlap_markdown(res: dict) -> str:
    """The doc's table of this run: per overlap measurement the three sweeps, the efficiency
    and where the streamed sweep's time went on its threads (medians over the rounds, ms)."""
    ms = lambda v: f"{v * 1e3:.0f}"
    head = ("| measurement | batch | compute only | read only | streamed | efficiency "
            "(per-round median) | stall (fill) | compute thread in streamed: run / wait / idle "
            "(alone: run / idle) | main run (wait) | others run (wait) |")
    rows = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for key, name in (("overlap", "one XLA thread, pinned to its own core"),
                      ("overlap_unpinned", "one XLA thread, not pinned"),
                      ("overlap_xla_default", "XLA default threads")):
        o = res.get(key)
        if o is None:
            continue
        t, c = o["threads_s"]["streamed"], o["threads_s"]["compute"]
        rows.append(
            f"| {name} | {o['batch']} | {ms(o['compute_only_s'])} | {ms(o['read_only_s'])} | "
            f"{ms(o['streamed_s'])} | **{o['overlap_efficiency']:.3f}** "
            f"({o['overlap_efficiency_per_round_median']:.3f}) | {ms(o['stall_s'])} "
            f"({ms(o['fill_stall_s'])}) | {ms(t['compute_run_s'])} / {ms(t['compute_wait_s'])} / "
            f"{ms(t['compute_idle_s'])} ({ms(c['compute_run_s'])} / {ms(c['compute_idle_s'])}) | "
            f"{ms(t['main_run_s'])} ({ms(t['main_wait_s'])}) | {ms(t['other_run_s'])} "
            f"({ms(t['other_wait_s'])}) |")
    o = res["overlap"]["config"]
    note = (f"\n{o['layers']} layers × {o['width']}² ({o['layer_bytes'] * o['layers'] / MiB:.0f} MiB), "
            f"prefetch {o['prefetch']}, {o['rounds']} rounds, load average "
            f"{o['loadavg_1min'][0]:.1f} → {o['loadavg_1min'][1]:.1f}.")
    if "read" in res:
        r = res["read"]
        note += (f" Store read / raw read (cold): **{r['read_ratio']:.3f}** "
                 f"(store {r['store_GBps']:.2f} GB/s, raw {r['raw_GBps']:.2f} GB/s).")
    return "\n".join(rows) + "\n" + note + "\n"


def layout_markdown(lay: dict) -> str:
    """The doc's table of the layout comparison: arrays opened, open time and cold read rate
    of each layout, without prefetch and with p = 2, and their ratio."""
    rows = ["| layout | arrays | open | MB/s, p = 0 | MB/s, p = 2 |", "|---|---|---|---|---|"]
    for k, name in (("per_leaf", "one array per leaf (the store's)"),
                    ("per_layer", "one array per layer per leaf")):
        rows.append(f"| {name} | {lay['files'][k]} | {lay['open_s'][k] * 1e3:.1f} ms | "
                    f"{lay['p0'][k + '_MBps']:.0f} | {lay['p2'][k + '_MBps']:.0f} |")
    return ("\n".join(rows) + f"\n\nRatio per leaf / per layer: **{lay['p0']['ratio']:.3f}** "
            f"without prefetch, {lay['p2']['ratio']:.3f} with p = 2 ({lay['layers']} layers, "
            f"{lay['bytes'] / MiB:.0f} MiB, medians of the passes).\n")


def write_doc(doc: str, res: dict) -> None:
    """Rewrites the ``streaming.py`` blocks of ``doc`` this run measured (a partial run keeps
    the others as the last full run wrote them)."""
    from jaxstream.experiment.docblock import write_tables

    command = "python benchmarks/streaming.py " + " ".join(sys.argv[1:])
    tables = {"overlap": overlap_markdown(res)}
    if "layout" in res:
        tables["layout"] = layout_markdown(res["layout"])
    write_tables(doc, "streaming.py", tables, command, keep=("layout",))


def report_partial(res: dict, json_path: str | None, doc: str | None = None) -> None:
    """Prints and writes the parts run with ``--only``."""
    rows = read_rows(res["read"]) if "read" in res else []
    if "overlap" in res:
        rows += overlap_rows("XLA 1 thread, pinned", res["overlap"])
        rows += overlap_rows("XLA 1 thread", res["overlap_unpinned"])
    print(f"loadavg {os.getloadavg()}")
    for a, b, c in rows:
        print(f"{a:<36} {b:>18}   {c}")
    out = {k: res[k][k + "_ratio" if k == "read" else "overlap_efficiency"]
           for k in ("read", "overlap") if k in res}
    if json_path:
        Path(json_path).write_text(json.dumps({**out, "details": res}, indent=2))
    if doc and "overlap" in res:
        write_doc(doc, res)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (< 2 minutes)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--doc", default=None,
                    help="rewrite this Markdown file's `streaming.py overlap` block (docs/streaming.md)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--crash-kills", type=int, default=0, help="SIGKILL crash runs (0: skip)")
    ap.add_argument("--only", choices=("read", "overlap", "read,overlap"), default=None,
                    help="run only (a) the read ratio and/or (b) the overlap (XLA on one thread)")
    ap.add_argument("--rounds", type=int, default=5, help="overlap rounds (median times)")
    ap.add_argument("--scale-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--overlap-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scale_worker:
        return scale_worker(args)
    if args.overlap_worker:
        return overlap_worker(args)
    q = args.quick
    read_w, read_l = (1024, 16) if q else (2048, 64)          # 64 MiB / 1 GiB
    scale_w, scale_l, budget = (512, 128, 16 * MiB) if q else (1448, 256, 256 * MiB)  # 8x
    work = Path(tempfile.mkdtemp(prefix="jaxstream-bench-", dir=args.dir))
    try:
        sections: dict = {}
        res = {"mode": "quick" if q else "full", "section_s": sections}

        def timed(name, fn, *a, **k):
            t0 = time.perf_counter()
            v = fn(*a, **k)
            sections[name] = round(time.perf_counter() - t0, 2)
            return v

        store, stack = timed("build", build_store, work / "read", read_w, read_l)
        only = set(args.only.split(",")) if args.only else {"read", "overlap"}
        if "read" in only:
            res["read"] = timed("read", bench_read, work / "read", store, passes=3)
        rounds = args.rounds
        # headline: XLA limited to one thread (its own process: set when the client is created),
        # so the reads keep the other core; beside it the default (all cores) in this process
        if "overlap" in only:
            # headline: XLA's compute thread on a core of its own (a compute device of its
            # own, as on a GPU); beside it the same process setup without pinning
            res["overlap"] = timed("overlap", bench_overlap_subprocess, work / "read", read_w,
                                   read_l, rounds, pin=True)
            res["overlap_unpinned"] = timed("overlap_unpinned", bench_overlap_subprocess,
                                            work / "read", read_w, read_l, rounds)
        if args.only:
            return report_partial(res, args.json, args.doc)
        if not q:
            res["overlap_xla_default"] = timed("overlap_xla_default", bench_overlap, work / "read",
                                               store, stack, rounds)
        res["layout"] = timed("layout", bench_layout, work, store, passes=5)
        shutil.rmtree(work / "read")
        # the timed parts are done: the scale worker (peak RSS) runs beside the equality check
        t0 = time.perf_counter()
        proc = start_scale(work / "scale", scale_w, scale_l, 2, budget)
        res["max_rel_err"] = timed("equality", bench_equality, q)
        res["scale"] = finish_scale(proc)
        sections["scale"] = round(time.perf_counter() - t0, 2)
        shutil.rmtree(work / "scale", ignore_errors=True)
        if args.crash_kills:
            import importlib.util

            spec = importlib.util.spec_from_file_location(
                "crash_harness", Path(__file__).parent.parent / "tests" / "stream" / "crash_harness.py")
            harness = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(harness)
            run_crash_experiment = harness.run_crash_experiment

            crash = timed("crash", run_crash_experiment, kills=args.crash_kills, steps=12,
                          workdir=str(work))
            shutil.rmtree(crash.pop("workdir"), ignore_errors=True)
            res["crash"] = crash
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sc = res["scale"]
    out = {"read_ratio": res["read"]["read_ratio"],
           "overlap_efficiency": res["overlap"]["overlap_efficiency"],
           "overlap_efficiency_unpinned": res["overlap_unpinned"]["overlap_efficiency"],
           "max_rel_err": res["max_rel_err"], "model_bytes": sc["model_bytes"],
           "budget_bytes": budget, "peak_rss_bytes": sc["peak_rss_bytes"],
           "baseline_rss_bytes": sc["baseline_rss_bytes"],
           "rss_above_baseline_bytes": sc["peak_rss_bytes"] - sc["baseline_rss_bytes"],
           "stall_s": res["overlap"]["stall_s"],
           "overlap_config": res["overlap"]["config"],
           "layout": {k: res["layout"][k] for k in ("per_leaf_MBps", "per_layer_MBps", "ratio")},
           "details": res}
    r, lay = res["read"], res["layout"]
    rows = read_rows(r)
    for name, o in (("XLA 1 thread, pinned", res["overlap"]), ("XLA 1 thread", res["overlap_unpinned"]),
                    ("XLA default", res.get("overlap_xla_default"))):
        if o is not None:
            rows += overlap_rows(name, o)
    o = res["overlap"]
    rows += [
        ("(b) planner prediction", f"{o['planner_step_s'] * 1e3:.1f} ms", f"min batch {o['planner_min_batch']}"),
        ("layout: one array per leaf", f"{lay['per_leaf_MBps']:.0f} MB/s",
         f"p=2: {lay['p2']['per_leaf_MBps']:.0f} MB/s"),
        ("layout: one array per layer", f"{lay['per_layer_MBps']:.0f} MB/s",
         f"p=2: {lay['p2']['per_layer_MBps']:.0f} MB/s; ratio {lay['ratio']:.3f} (p=2: {lay['p2']['ratio']:.3f})"),
        ("(c) model / budget", f"{sc['model_bytes'] / MiB:.0f} MiB", f"{budget / MiB:.0f} MiB"),
        ("(c) peak RSS - constant", f"{out['rss_above_baseline_bytes'] / MiB:.0f} MiB",
         f"constant {sc['baseline_rss_bytes'] / MiB:.0f} MiB, step {np.mean(sc['step_s']):.2f} s"),
        ("streamed vs in-memory grads", f"max rel err {res['max_rel_err']:.2e}", "fp32"),
    ]
    if "crash" in res:
        c = res["crash"]
        rows.append(("SIGKILL crash runs", f"{c['kills']} kills",
                     f"opened at commit: {c['opened_at_committed_step']}, resumed equal: {c['resumed_equal']}"))
    print(f"overlap: {o['config']['width']}-wide layers x {o['config']['layers']}, prefetch "
          f"{o['config']['prefetch']}, fp32, loadavg {o['config']['loadavg_1min'][0]:.1f}")
    for a, b, c in rows:
        print(f"{a:<36} {b:>18}   {c}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if args.doc:
        write_doc(args.doc, res)


if __name__ == "__main__":
    main()
