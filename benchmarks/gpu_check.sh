#!/usr/bin/env bash
# GPU check of the streamed step (one H100/H200, under 8 minutes; CI never runs it).
#
# bf16, mlp(64, 4096, 8, 10), 8 micro-batches, SGD, page cache warm. For the batch at the
# planner's compute-bound minimum (jaxstream.stream.planner.plan, with this machine's measured
# matmul rate and store read bandwidth) and 1.25x it:
#   * the north-star ratios: streamed step / in-memory step per estimator (north_star.py's
#     cases, interleaved; hybrid_eager_q2: two host updates in flight), with blocking
#     transfers and idle per cause;
#   * the planner's predicted step against the measured streamed step;
#   * a jax.profiler trace of two streamed steps and its summary (device busy fraction, the
#     busiest ops and host events).
# It installs nothing: it runs with whatever python is active (or $PYTHON) and stops with one
# line when JAX sees no GPU.
#
# Usage:
#   benchmarks/gpu_check.sh [--out DIR] [--rounds N] [--width W] [--estimators NAME...]
#   benchmarks/gpu_check.sh --dry-run [--device-flops R] [--read-bandwidth W]   # plan only
# Writes DIR/gpu_check.json (default DIR: gpu_check_out) and DIR/trace/.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "error: no '$PY' on PATH: activate the environment that has jaxstream (or set PYTHON=)" >&2
  exit 2
fi
LIMIT="${GPU_CHECK_LIMIT_S:-470}"  # stays under 8 minutes with start-up and the summary
exec timeout --signal=INT "$LIMIT" "$PY" - "$HERE" "$@" <<'PYTHON'
import argparse
import gzip
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

T0 = time.perf_counter()
HERE = sys.argv[1]
sys.path.insert(0, HERE)
p = argparse.ArgumentParser(prog="gpu_check.sh", description="GPU check of the streamed step")
p.add_argument("--out", default="gpu_check_out", help="directory for the JSON and the trace")
p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per batch")
p.add_argument("--width", type=int, default=4096)
p.add_argument("--depth", type=int, default=8)
p.add_argument("--estimators", nargs="+",
               default=["backprop", "forward_weights", "forward_activations", "hybrid_eager",
                        "hybrid_lazy", "hybrid_eager_q2"])
p.add_argument("--budget-s", type=float, default=420.0,
               help="stop starting new parts after this many seconds")
p.add_argument("--dry-run", action="store_true",
               help="print the plan and what would run; needs no GPU")
p.add_argument("--device-flops", type=float, default=None,
               help="matmul FLOP/s (default: measured; --dry-run without it assumes 4e14)")
p.add_argument("--read-bandwidth", type=float, default=None,
               help="store read bytes/s (default: measured in --out)")
args = p.parse_args(sys.argv[2:])
for name in ("rounds", "width", "depth"):
    if getattr(args, name) < 1:
        p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

import north_star as ns  # noqa: E402

ALLOWED = ns.ESTIMATORS + tuple(e + ns.IN_FLIGHT_2 for e in ns.ESTIMATORS)
bad = [e for e in args.estimators if e not in ALLOWED]
if bad:
    p.error(f"--estimators: unknown {bad}; allowed: {', '.join(ALLOWED)}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

if not args.dry_run and jax.default_backend() != "gpu":
    print(f"error: JAX sees no GPU (backend {jax.default_backend()!r}, devices "
          f"{[d.device_kind for d in jax.devices()]}): run this on the GPU machine with a "
          "CUDA build of jaxlib, or pass --dry-run", file=sys.stderr)
    sys.exit(2)

from jaxstream.experiment.plan_cli import measure_read_bandwidth  # noqa: E402
from jaxstream.models import mlp  # noqa: E402
from jaxstream.stream.planner import layer_cost, plan  # noqa: E402

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
report: dict = {"width": args.width, "depth": args.depth, "dtype": "bfloat16",
                "micro_batches": ns.MICRO, "device": str(jax.devices()[0].device_kind)}


def rate() -> float:
    """bf16 matmul FLOP/s of the device (8192^3, best of 5)."""
    n = 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


flops = args.device_flops or (4e14 if args.dry_run else rate())
bandwidth = args.read_bandwidth or measure_read_bandwidth(str(out))
stats = {} if args.dry_run else (jax.devices()[0].memory_stats() or {})
memory = float(stats.get("bytes_limit", 8e10))
stack = mlp(ns.IN_DIM, args.width, args.depth, ns.CLASSES)
shapes = jax.eval_shape(stack.init, jax.random.key(0))
cost = layer_cost(stack, shapes, {"x": jax.ShapeDtypeStruct((8, ns.IN_DIM), jnp.float32)})
base = plan(cost, device_flops=flops, read_bandwidth=bandwidth, device_memory=memory,
            compute_bytes=2)
batches = [ns.MICRO * math.ceil(b / ns.MICRO) for b in (base.min_batch, 1.25 * base.min_batch)]
report.update(device_flops=flops, read_bandwidth=bandwidth, device_memory=memory,
              min_batch=base.min_batch, batches=batches)
print(f"device {report['device']}: {flops / 1e12:.0f} TFLOP/s bf16 matmul, store reads "
      f"{bandwidth / 1e9:.2f} GB/s, memory {memory / 2**30:.0f} GiB; planner's compute-bound "
      f"batch {base.min_batch} -> batches {batches} ({ns.MICRO} micro-batches each)", flush=True)
if args.dry_run:
    for b in batches:
        print(f"would run: batch {b}: {', '.join(args.estimators)}, {args.rounds} rounds, "
              f"predicted streamed step {plan(cost, device_flops=flops, read_bandwidth=bandwidth, device_memory=memory, compute_bytes=2, batch=b).step_time * 1e3:.1f} ms")
    print(f"would trace two streamed backprop steps into {out / 'trace'}")
    sys.exit(0)

report["runs"] = {}
for b in batches:
    if time.perf_counter() - T0 > args.budget_s:
        print(f"skipped batch {b}: past --budget-s {args.budget_s:.0f}", flush=True)
        continue
    res = ns.run([args.width], args.estimators, ["warm"], args.rounds,
                 log=lambda s: print(s, flush=True), micro=ns.MICRO,
                 micro_size=b // ns.MICRO, dtype="bfloat16", depth=args.depth)
    predicted = plan(cost, device_flops=flops, read_bandwidth=bandwidth, device_memory=memory,
                     compute_bytes=2, batch=b).step_time
    for r in res.values():
        r["predicted_s"] = predicted
        r["measured_over_predicted"] = r["streamed_s"]["median"] / predicted
    report["runs"][str(b)] = res
    print(f"\nbatch {b} (planner predicts a streamed step of {predicted * 1e3:.1f} ms):")
    print(ns.table(res))
    print("measured / predicted: " + ", ".join(
        f"{r['estimator']} {r['measured_over_predicted']:.2f}" for r in res.values()), flush=True)


def summarise_trace(trace_dir: Path) -> dict:
    """Device busy fraction over the traced span, the busiest device ops and host events."""
    files = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not files:
        return {"error": f"no perfetto_trace.json.gz under {trace_dir}"}
    events = json.loads(gzip.open(files[-1]).read())
    events = events["traceEvents"] if isinstance(events, dict) else events
    procs = {e["pid"]: e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = [e for e in spans if "gpu" in procs.get(e["pid"], "").lower()]
    host = [e for e in spans if e not in device]
    total = defaultdict(float)
    for e in device:
        total[e["name"]] += e["dur"]
    busy, end = 0.0, -math.inf
    for s, d in sorted((e["ts"], e["dur"]) for e in device):
        busy += max(0.0, s + d - max(s, end))
        end = max(end, s + d)
    start = min((e["ts"] for e in spans), default=0.0)
    stop = max((e["ts"] + e["dur"] for e in spans), default=0.0)
    host_total = defaultdict(float)
    for e in host:
        host_total[e["name"]] += e["dur"]
    top = lambda d: [[k, v / 1e3] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:10]]  # noqa: E731
    return {"span_ms": (stop - start) / 1e3, "device_busy_ms": busy / 1e3,
            "device_busy_fraction": busy / max(stop - start, 1e-9),
            "top_device_ops_ms": top(total), "top_host_events_ms": top(host_total),
            "file": str(files[-1])}


if time.perf_counter() - T0 < args.budget_s:
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        case = ns.Case("backprop", args.width, work, micro=ns.MICRO,
                       micro_size=batches[0] // ns.MICRO, dtype="bfloat16", depth=args.depth)
        counter = ns.BlockingCounter()
        with counter.installed():
            case.streamed(0, False, counter)  # compile outside the trace
            with jax.profiler.trace(str(out / "trace"), create_perfetto_trace=True):
                for s in (1, 2):
                    with jax.profiler.StepTraceAnnotation("streamed_step", step_num=s):
                        case.streamed(s, False, counter)
        case.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["trace"] = summarise_trace(out / "trace")
    t = report["trace"]
    if "error" in t:
        print(f"trace: {t['error']}")
    else:
        print(f"\ntrace of 2 streamed backprop steps: span {t['span_ms']:.1f} ms, device busy "
              f"{t['device_busy_ms']:.1f} ms ({t['device_busy_fraction']:.0%})")
        for name, ms in t["top_device_ops_ms"]:
            print(f"  device {ms:9.2f} ms  {name[:90]}")
        for name, ms in t["top_host_events_ms"][:5]:
            print(f"  host   {ms:9.2f} ms  {name[:90]}")
else:
    print("skipped the profiler trace: past --budget-s")

report["elapsed_s"] = time.perf_counter() - T0
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(f"\nwrote {out / 'gpu_check.json'} in {report['elapsed_s']:.0f} s")
PYTHON
