"""Where a step's CPU goes: CPU seconds per step by thread, in memory against streamed.

On a CPU backend the "device" and the host share the machine's cores: XLA's compute pool
(``tf_XLAEigen``), the Python threads (the main thread dispatching, the host-update worker,
the prefetch readers), TensorStore's I/O pool (``ts_pool_worker``). A streamed step can be
no shorter than its CPU seconds over the cores it can use, so this says how much of the
north star's excess (``benchmarks/north_star.py``) is host work that competes with the
compute, and which threads do it. Linux only (``/proc/self/task/*/schedstat``).

Two floors on streamed / in-memory wall time follow on a machine whose cores the host and the
compute share: this implementation's (its CPU over the cores), and any implementation's that
moves the bytes this step moves (the in-memory step's CPU — the compute both must run — plus
the CPU of writing the step's bytes durably and reading its bytes back, at per-byte rates
measured in the same run by :func:`io_costs`, over the cores). Where the second floor exceeds
a goal, no overlap reaches that goal on this machine with those writes.

Same model and steps as the north star (``mlp(64, W, 8, 10)``, 8 × 16, SGD, fp32); each
side runs ``--steps`` steps after two warm-up steps; per thread name, the CPU seconds per step
(threads of one name summed: the Python threads all share ``python``); threads that ended in
the window (the prefetch readers end with each sweep) are the process's CPU the live ones
leave.

Usage:
  python benchmarks/step_cpu.py --widths 256 1024 --json cpu.json
  python benchmarks/step_cpu.py --widths 256 1024 2048 --doc docs/streaming.md
  python benchmarks/step_cpu.py --widths 1024 2048 --estimator backprop hybrid_eager
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


def io_costs(nbytes: int, directory: Path, repeat: int = 8) -> dict:
    """CPU seconds per byte, on this machine and file system, of the least a streamed step
    must do per byte: write a chunk durably (``os.write`` of the data and its crc32c, then
    ``fsync``: what a commit needs before its manifest; the store's TensorStore path does
    more) and read one back as the store does (:class:`ChunkRead`: ``O_DIRECT`` where the file
    system allows it, crc32c checked)."""
    import crc32c
    import numpy as np

    from jaxstream.stream.direct_read import ChunkRead

    data = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    raw = data.view(np.uint8)
    files = [directory / f"chunk{i}" for i in range(repeat)]
    t0 = time.process_time()
    for f in files:
        fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, raw.tobytes() + crc32c.crc32c(raw).to_bytes(4, "little"))
            os.fsync(fd)
        finally:
            os.close(fd)
    write = (time.process_time() - t0) / (repeat * raw.nbytes)
    t0 = time.process_time()
    for f in files:
        ChunkRead(str(f), data.shape, data.dtype, str(f)).result()
    read = (time.process_time() - t0) / (repeat * raw.nbytes)
    for f in files:
        f.unlink()
    return {"write_s_per_byte": write, "read_s_per_byte": read}


def run(widths: list[int], estimator: str, steps: int) -> dict:
    out = {}
    for width in widths:
        work = Path(tempfile.mkdtemp(prefix="step_cpu_"))
        case = ns.Case(estimator, width, work)
        counter = ns.BlockingCounter()
        moved: list = []  # each step's bytes (a lazy step writes a layer on some steps only)
        try:
            for i in range(2):
                case.memory(10_000 + i)
                case.streamed(10_000 + i, False, counter)
            mem = measure(case.memory, steps)
            st = measure(lambda i, c=case, n=counter, m=moved: m.append(c.streamed(i, False, n)),
                         steps)
        finally:
            case.close()
        for k in ("bytes_read", "bytes_written"):
            st[k] = sum(m[k] for m in moved) / len(moved)
        io = io_costs(4 * width * width, work)
        out[str(width)] = {"memory": mem, "streamed": st, "io": io,
                           "floor": floor(mem, st, io, cores())}
    return out


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def floor(mem: dict, st: dict, io: dict, n: int) -> dict:
    """Lower bounds on streamed / in-memory wall time on ``n`` shared cores: this
    implementation's (its CPU over the cores) and any implementation's that writes what this
    step writes durably and reads what it reads (the in-memory step's CPU, the compute both
    run, plus those bytes at :func:`io_costs`' rates, over the cores)."""
    io_cpu = (st["bytes_written"] * io["write_s_per_byte"]
              + st["bytes_read"] * io["read_s_per_byte"])
    return {"cores": n, "io_cpu_s": io_cpu,
            "this_implementation": st["cpu_s"] / n / mem["wall_s"],
            "any_implementation": (mem["cpu_s"] + io_cpu) / n / mem["wall_s"]}


def table(results: dict, estimator: str) -> str:
    lines = [("| width | side | wall ms | CPU ms | CPU / wall | XLA pool | Python threads | "
              "TensorStore pool | ended threads (prefetch readers) | read / written MiB (mean) | "
              "floor: this step's CPU / cores | floor: in-memory CPU + its I/O's CPU, / cores |"),
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for width, r in results.items():
        for side in ("memory", "streamed"):
            x, th, f = r[side], r[side]["threads_s"], r["floor"]
            tail = ("| – | | |" if side == "memory" else
                    f"| {x['bytes_read'] / 2**20:.1f} / {x['bytes_written'] / 2**20:.1f} | "
                    f"**{f['this_implementation']:.2f}** | **{f['any_implementation']:.2f}** |")
            lines.append(
                f"| {width} | {side} ({estimator}) | {x['wall_s'] * 1e3:.1f} | "
                f"{x['cpu_s'] * 1e3:.1f} | {x['cpu_s'] / x['wall_s']:.2f} | "
                f"{th.get('tf_XLAEigen', 0) * 1e3:.1f} | {th.get('python', 0) * 1e3:.1f} | "
                f"{th.get('ts_pool_worker', 0) * 1e3:.1f} | {th.get('ended', 0) * 1e3:.1f} "
                f"{tail}")
    first = next(iter(results.values()))
    rates = ", ".join(f"width {w}: write {r['io']['write_s_per_byte'] * 2**20 * 1e3:.2f}, "
                      f"read {r['io']['read_s_per_byte'] * 2**20 * 1e3:.2f}"
                      for w, r in results.items())
    body = "\n".join(lines)
    return (f"{body}\n\nFloors over the in-memory step's wall time on "
            f"{first['floor']['cores']} cores. CPU ms per MiB, a durable chunk write "
            f"(write + crc32c + fsync) and the store's direct read: {rates}.")


#: The north star's goals for streamed / in-memory (warm page cache), by width.
GOALS = {256: 2.5, 1024: 1.25, 2048: 1.25}


def excluded(runs: dict) -> str:
    """The sentence saying which of the north star's goals (:data:`GOALS`) the second floor
    puts out of reach on this machine, and which it leaves open."""
    out, open_, own = [], [], []
    for e, results in runs.items():
        for width, r in results.items():
            goal = GOALS.get(int(width))
            if goal is None:
                continue
            f, mine = r["floor"]["any_implementation"], r["floor"]["this_implementation"]
            (out if f > goal else open_).append(
                f"{e} at {width} ({f:.2f} {'>' if f > goal else '≤'} {goal})")
            if f <= goal < mine:
                own.append(f"{e} at {width} ({mine:.2f})")
    return ("Goals out of reach on this machine by the second floor (no overlap, however good, "
            f"writes and reads these bytes in less): {', '.join(out) or 'none'}. Within reach "
            f"by it: {', '.join(open_) or 'none'}. Of those, this implementation's own CPU "
            f"over the cores (the first floor) is above the goal at: {', '.join(own) or 'none'}"
            " — its host work, not the bytes, is what stands between them and the goal.")


def tables(doc: dict) -> str:
    """One :func:`table` per estimator of a run (a run of one estimator, as written before
    runs measured several: ``results`` and ``estimator``), and which goals the floor excludes."""
    runs = doc.get("runs") or {doc["estimator"]: doc["results"]}
    return "\n\n".join([*(table(results, e) for e, results in runs.items()), excluded(runs)])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--estimator", nargs="+", default=["backprop"], choices=ns.ESTIMATORS,
                   help="one table each, in one run")
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
        doc = {"command": command, "environment": ns.environment(), "steps": args.steps,
               "runs": {e: run(args.widths, e, args.steps) for e in args.estimator}}
    text = tables(doc)
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
