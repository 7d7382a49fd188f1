"""Where a step's CPU goes: CPU seconds per step by thread, in memory against streamed.

On a CPU backend the "device" and the host share the machine's cores: XLA's compute pool
(``tf_XLAEigen``), the Python threads (the main thread dispatching, the host-update worker,
the prefetch readers), TensorStore's I/O pool (``ts_pool_worker``). A streamed step can be
no shorter than its CPU seconds over the cores it can use, so this says how much of the
north star's excess (``benchmarks/north_star.py``) is host work that competes with the
compute, and which threads do it. Linux only (``/proc/self/task/*/schedstat``).

Same model and steps as the north star (``mlp(64, W, 8, 10)``, 8 × 16, SGD, fp32); each
side runs ``--steps`` steps after two warm-up steps; per thread name, the CPU seconds per step
(threads of one name summed: the Python threads all share ``python``); threads that ended in
the window (the prefetch readers end with each sweep) are the process's CPU the live ones
leave.

Usage:
  python benchmarks/step_cpu.py --widths 256 1024 --json cpu.json
  python benchmarks/step_cpu.py --widths 256 1024 2048 --doc docs/streaming.md
  python benchmarks/step_cpu.py --from-json cpu.json --doc docs/streaming.md
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import north_star as ns
import thread_time as tt


def _names() -> dict[int, str]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            pass
    return out


def measure(step, steps: int) -> dict:
    """Wall and CPU seconds per step of ``step(i)``, and CPU per thread name."""
    before, p0, t0 = tt.snapshot(), time.process_time(), time.perf_counter()
    for i in range(steps):
        step(i)
    wall, cpu = (time.perf_counter() - t0) / steps, (time.process_time() - p0) / steps
    after, names = tt.snapshot(), _names()
    per: collections.Counter = collections.Counter()
    for tid, (run, _) in after.items():
        per[names.get(tid, "?")] += (run - before.get(tid, (0, 0))[0]) / 1e9 / steps
    # threads that ended inside the window (the prefetch readers end with their sweep) are
    # gone from /proc: the process's CPU they leave
    per["ended"] = max(0.0, cpu - sum(per.values()))
    return {"wall_s": wall, "cpu_s": cpu, "threads_s": dict(per.most_common())}


def run(widths: list[int], estimator: str, steps: int) -> dict:
    out = {}
    for width in widths:
        case = ns.Case(estimator, width, Path(tempfile.mkdtemp(prefix="step_cpu_")))
        counter = ns.BlockingCounter()
        try:
            for i in range(2):
                case.memory(10_000 + i)
                case.streamed(10_000 + i, False, counter)
            mem = measure(case.memory, steps)
            st = measure(lambda i, c=case, n=counter: c.streamed(i, False, n), steps)
        finally:
            case.close()
        out[str(width)] = {"memory": mem, "streamed": st}
    return out


def table(results: dict, estimator: str) -> str:
    lines = [("| width | side | wall ms | CPU ms | CPU / wall | XLA pool | Python threads | "
              "TensorStore pool | ended threads (prefetch readers) | "
              "streamed wall ≥ CPU / 2 cores, / in-memory wall |"),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for width, r in results.items():
        for side in ("memory", "streamed"):
            x = r[side]
            th = x["threads_s"]
            floor = (f"{x['cpu_s'] / 2 / r['memory']['wall_s']:.2f}" if side == "streamed"
                     else "")
            lines.append(
                f"| {width} | {side} ({estimator}) | {x['wall_s'] * 1e3:.1f} | "
                f"{x['cpu_s'] * 1e3:.1f} | {x['cpu_s'] / x['wall_s']:.2f} | "
                f"{th.get('tf_XLAEigen', 0) * 1e3:.1f} | {th.get('python', 0) * 1e3:.1f} | "
                f"{th.get('ts_pool_worker', 0) * 1e3:.1f} | {th.get('ended', 0) * 1e3:.1f} | "
                f"{floor} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--estimator", default="backprop", choices=ns.ESTIMATORS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--doc", default=None, help="write the table into this doc's block")
    p.add_argument("--from-json", default=None, help="render an earlier run (no measuring)")
    args = p.parse_args(argv)
    if args.steps < 1 or any(w < 1 for w in args.widths):
        p.error("--steps and --widths must be positive")
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
    else:
        command = "python benchmarks/step_cpu.py " + " ".join(
            sys.argv[1:] if argv is None else argv)
        results = run(args.widths, args.estimator, args.steps)
        doc = {"command": command, "environment": ns.environment(),
               "estimator": args.estimator, "steps": args.steps, "results": results}
    text = table(doc["results"], doc["estimator"])
    print(text)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    if args.doc:
        from jaxstream.experiment.docblock import write_tables

        if not write_tables(args.doc, "step_cpu.py", {"table": text}, doc["command"],
                            where=doc["environment"]["machine"]):
            raise SystemExit(f"error: {args.doc} has no <!-- generated: step_cpu.py table --> "
                             "block")
    return doc


if __name__ == "__main__":
    main()
