"""Compiled temporary memory and step time of inference, backprop, forward and hybrid steps.

A deep MLP (width 512, batch 1024, depth 8 / 16 / 32 / 64). For each depth and each mode the
step is compiled with ``jax.jit(f).lower(...).compile()``; ``memory_analysis()`` gives XLA's
temporary buffer size (activations, tangents, scratch; params, batch and outputs excluded) and
the median of timed runs gives the step time (the modes timed in interleaved rounds, one run
of each per round, so a shared machine's load hits them alike); :func:`jaxstream.quality.flops.matmul_flops`
counts the matrix-multiply FLOPs the compiled step runs (loops by their trip counts), the
machine-independent cost. Modes:

* ``inference`` — the mean loss only (one forward pass);
* ``backprop`` — ``jaxstream.grad.backprop()``, the reference;
* ``backprop_remat`` — ``jaxstream.grad.backprop_remat()``: each block under ``jax.checkpoint``
  (block inputs kept, the inside recomputed in the backward pass);
* ``forward`` — ``jaxstream.grad.forward(num_tangents=1)`` (weight perturbation, tangents
  regenerated per layer inside the scan over blocks);
* ``hybrid`` — ``jaxstream.grad.hybrid(num_exact=2, correction="control_variate")`` on 16
  micro-batches of 64 (2 of them exact).

Prints a table with ratios vs backprop and vs inference, side by side, from the same run, and
the hybrid's time floor: its FLOPs at the best FLOP rate any mode reached in the run.

``--parts`` adds where the hybrid's memory and time go, each part compiled alone with its
alternatives (:mod:`hybrid_parts`), timed in the same interleaved rounds as the modes, and the
floor of a hybrid that draws its tangents twice (:func:`jaxstream_lab.table_cost.redraw_floor`). docs/results.md renders the ``--json`` rows
(``forward_table.py --memory-json``).

Usage:
  python benchmarks/memory_time.py                 # depths 8 16 32 64
  python benchmarks/memory_time.py --quick         # depths 8 32, fewer repeats (< 2 min)
  python benchmarks/memory_time.py --depths 8 32 --repeats 9 --parts --json docs/memory_time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import jaxstream.grad as jg
from jaxstream.experiment.docblock import machine
from jaxstream.models import mlp
from jaxstream.quality.flops import matmul_flops
from jaxstream_lab.table_cost import time_floor

MODES = ("inference", "backprop", "backprop_remat", "forward", "hybrid")
PART = "part: "  # prefix of the hybrid's parts among the timed functions (--parts)
NUM_MICRO, NUM_EXACT = 16, 2


def make_problem(depth: int, width: int, batch: int, seed: int = 0) -> tuple[Any, Any, dict]:
    """A ``depth``-block MLP of ``width`` (input dim = width, 10 classes) and a random batch."""
    stack = mlp(in_dim=width, width=width, depth=depth, num_classes=10)
    params = stack.init(jax.random.key(seed))
    kx, ky = jax.random.split(jax.random.key(seed + 1))
    data = {
        "x": jax.random.normal(kx, (batch, width), jnp.float32),
        "y": jax.random.randint(ky, (batch,), 0, 10),
    }
    return stack, params, data


def step_functions(stack: Any) -> dict[str, Callable]:
    """``mode -> f(params, batch, key)`` returning the loss (and grads for estimators)."""
    forward = jg.forward(num_tangents=1)
    hybrid = jg.hybrid(num_exact=NUM_EXACT, correction="control_variate")
    backprop = jg.backprop()
    remat = jg.backprop_remat()

    return {
        "inference": lambda p, b, k: stack(p, b),
        "backprop": lambda p, b, k: backprop(stack, p, b, k),
        "backprop_remat": lambda p, b, k: remat(stack, p, b, k),
        "forward": lambda p, b, k: forward(stack, p, b, k),
        "hybrid": lambda p, b, k: hybrid(stack, p, micro_batches(b), k),
    }


def micro_batches(batch: Any) -> Any:
    """The batch as ``NUM_MICRO`` micro-batches (leading axis)."""
    return jax.tree.map(lambda a: a.reshape((NUM_MICRO, -1) + a.shape[1:]), batch)


def measure_all(fns: dict[str, Callable], args: tuple,
                repeats: int) -> dict[str, tuple[int, float, int, list[float]]]:
    """``name -> (temp bytes, median ms, matmul FLOPs, every timed ms)``: every step compiled
    and warmed up first, then timed in interleaved rounds (one run of each step per round), so
    load from other work on a shared machine hits every step alike and the ratios between
    steps stay comparable."""
    CPU_MS.clear()
    compiled = {name: jax.jit(fn).lower(*args).compile() for name, fn in fns.items()}
    for c in compiled.values():
        jax.block_until_ready(c(*args))  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, c in compiled.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(c(*args))
            times[name].append((time.perf_counter() - t0) * 1e3)
            CPU_MS.setdefault(name, []).append((time.process_time() - c0) * 1e3)
    return {name: (int(c.memory_analysis().temp_size_in_bytes), statistics.median(times[name]),
                   matmul_flops(c), times[name]) for name, c in compiled.items()}


# name -> process CPU milliseconds of each timed run of the last measure_all (every thread of
# the process: on a loaded machine the work a step did, where its wall time also counts waits
# for a core)
CPU_MS: dict[str, list[float]] = {}


def run(depths: list[int], width: int, batch: int, repeats: int,
        parts: bool = False) -> list[dict]:
    """One row per depth: ``{"depth", "temp_bytes": {mode: int}, "step_ms": {mode: float},
    "flops": {mode: int}}`` (with ``parts``: ``"parts": {name: [temp, ms, flops]}`` and
    ``"backprop": [temp, ms, flops]``)."""
    rows = []
    for depth in depths:
        stack, params, data = make_problem(depth, width, batch)
        key = jax.random.key(42)
        row: dict[str, Any] = {"depth": depth, "temp_bytes": {}, "step_ms": {}, "flops": {}}
        row["times_ms"] = {}
        fns = step_functions(stack)
        if parts:  # timed in the same interleaved rounds as the modes: load hits all alike
            from hybrid_parts import part_functions

            fns.update({PART + name: (lambda p, b, k, fn=fn: fn(p, micro_batches(b), k))
                        for name, fn in part_functions(stack, NUM_MICRO).items()})
        measured = measure_all(fns, (params, data, key), repeats)
        for mode, (temp, ms, flops, times) in measured.items():
            if mode.startswith(PART):
                row.setdefault("parts", {})[mode[len(PART):]] = [temp, ms, flops]
                continue
            row["temp_bytes"][mode] = temp
            row["step_ms"][mode] = ms
            row["flops"][mode] = flops
            row["times_ms"][mode] = times
        row["cpu_ms"] = {mode: statistics.median(t) for mode, t in CPU_MS.items()
                         if not mode.startswith(PART)}
        if parts:
            row["backprop"] = [row[k]["backprop"] for k in ("temp_bytes", "step_ms", "flops")]
        rows.append(row)
        print(format_rows([row], header=len(rows) == 1), flush=True)
    return rows


def round_spread(row: dict, base: str = "backprop", median: bool = False) -> str:
    """min–max over the interleaved rounds of hybrid / ``base`` (each round's own pair;
    ``median``: their median first)."""
    times = row.get("times_ms")
    if not times:
        return "–"
    ratios = [h / b for h, b in zip(times["hybrid"], times[base])]
    spread = f"{min(ratios):.2f}–{max(ratios):.2f}"
    return f"{statistics.median(ratios):.2f} ({spread})" if median else spread


def format_rows(rows: list[dict], header: bool = True) -> str:
    """Table: temp MiB and step ms per mode, then the ratios vs backprop and vs inference."""
    cols = [("depth", 5)]
    short = {"backprop_remat": "rmat"}
    cols += [(f"tmp MiB {short.get(m, m[:4])}", 12) for m in MODES]
    cols += [("fwd/bp", 7), ("fwd/inf", 7), ("hyb/bp", 7), ("rmat/bp", 7)]
    cols += [(f"ms {short.get(m, m[:4])}", 9) for m in MODES]
    cols += [("fwd/bp", 7), ("fwd/inf", 7), ("hyb/bp", 7), ("rmat/bp", 7)]
    cols += [("GF bp", 7), ("flop fwd/bp", 11), ("flop hyb/bp", 11), ("flop rmat/bp", 12),
             ("hyb floor/bp", 12), ("hyb/bp per round", 17), ("hyb/rmat per round", 19),
             ("cpu hyb/bp", 10),
             ("cpu rmat/bp", 11), ("cpu fwd/bp", 10)]
    lines = []
    if header:
        lines.append(" ".join(name.rjust(w) for name, w in cols))
    for r in rows:
        t, s = r["temp_bytes"], r["step_ms"]
        vals = [str(r["depth"])]
        vals += [f"{t[m] / 2**20:.2f}" for m in MODES]
        vals += [f"{t['forward'] / max(t['backprop'], 1):.3f}"]
        vals += [f"{t['forward'] / max(t['inference'], 1):.3f}"]
        vals += [f"{t['hybrid'] / max(t['backprop'], 1):.3f}"]
        vals += [f"{t['backprop_remat'] / max(t['backprop'], 1):.3f}"]
        vals += [f"{s[m]:.1f}" for m in MODES]
        vals += [f"{s['forward'] / s['backprop']:.2f}", f"{s['forward'] / s['inference']:.2f}"]
        vals += [f"{s['hybrid'] / s['backprop']:.2f}", f"{s['backprop_remat'] / s['backprop']:.2f}"]
        f = r["flops"]
        vals += [f"{f['backprop'] / 1e9:.2f}"]
        vals += [f"{f[m] / f['backprop']:.3f}" for m in ("forward", "hybrid", "backprop_remat")]
        vals += [f"{time_floor(r)['floor']:.2f}", round_spread(r),
                 round_spread(r, "backprop_remat", median=True)]
        cpu = r.get("cpu_ms") or {}
        vals += [f"{cpu[m] / cpu['backprop']:.2f}" if m in cpu else "–"
                 for m in ("hybrid", "backprop_remat", "forward")]
        lines.append(" ".join(v.rjust(w) for v, (_, w) in zip(vals, cols)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=None)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per step")
    parser.add_argument("--quick", action="store_true", help="depths 8 32, 3 repeats")
    parser.add_argument("--json", type=str, default=None, help="write the rows to this path")
    parser.add_argument("--parts", action="store_true",
                        help="also measure the hybrid's parts and their alternatives")
    args = parser.parse_args(argv)
    if args.batch % NUM_MICRO:
        parser.error(f"--batch must be a multiple of {NUM_MICRO} (hybrid micro-batches)")
    depths = args.depths or ([8, 32] if args.quick else [8, 16, 32, 64])
    repeats = args.repeats or (3 if args.quick else 7)
    print(
        f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
        f"width={args.width} batch={args.batch} repeats={repeats} "
        f"hybrid={NUM_EXACT}/{NUM_MICRO} exact, control_variate"
    )
    rows = run(depths, args.width, args.batch, repeats, parts=args.parts)
    print()
    print(format_rows(rows))
    cmd = "python benchmarks/memory_time.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.parts:
        from jaxstream_lab.table_cost import memory_parts_table, redraw_floor_text

        print()
        print(memory_parts_table(rows))
        print(redraw_floor_text(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        meta = {"command": cmd, "machine": machine()}
        with open(args.json + ".meta", "w") as f:
            json.dump(meta, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
