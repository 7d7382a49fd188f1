"""Grouped units: the streamed step / the in-memory step with G consecutive layers per unit.

At small widths a streamed step is mostly per-unit work — a read waited for, a program
dispatched, a host update — not compute; ``layers_per_unit`` (:class:`StreamConfig`) reads G
layers, puts them on the device together and runs them as one scanned program. This measures
the north star's ratio (its model, batch and in-memory baseline, :mod:`north_star`, warm page
cache) for G = 1, 2, 4, 8, the cases interleaved round by round in one process; medians and
min–max of the per-round ratios.

Usage:
  python benchmarks/grouped_units.py                          # widths 256 1024, 5 rounds
  python benchmarks/grouped_units.py --json g.json --doc docs/streaming.md
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from north_star import BlockingCounter, Case

GROUPS = (1, 2, 4, 8)
ESTIMATORS = ("backprop", "forward_weights")


def measure(widths: list[int], groups: list[int], estimators: list[str], rounds: int) -> list:
    """Rows of (width, estimator, G): in-memory and streamed medians, the ratio's median and
    range over rounds, layers read per step."""
    rows, counter = [], BlockingCounter()
    with counter.installed():
        for width in widths:
            work = Path(tempfile.mkdtemp(prefix=f"grouped_{width}_"))
            try:
                cases = {(e, g): Case(e, width, work, layers_per_unit=g)
                         for e in estimators for g in groups}
                for c in cases.values():  # compile both sides, fill the store's slots
                    c.memory(10_000)
                    c.streamed(10_000, False, counter)
                got = {k: [] for k in cases}
                for r in range(rounds):
                    for k, c in cases.items():
                        mem = c.memory(r)
                        step = c.streamed(r, False, counter)
                        got[k].append((mem, step["wall_s"], step.get("layers_read", 0)))
                    print(f"width {width}: round {r + 1}/{rounds}", file=sys.stderr)
                for (e, g), xs in got.items():
                    ratios = [s / m for m, s, _ in xs]
                    rows.append({"width": width, "estimator": e, "layers_per_unit": g,
                                 "memory_ms": 1e3 * statistics.median(m for m, _, _ in xs),
                                 "streamed_ms": 1e3 * statistics.median(s for _, s, _ in xs),
                                 "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                                 "ratio_max": max(ratios), "layers_read": xs[-1][2]})
                    cases[(e, g)].close()
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [("| width | estimator | layers per unit | in memory (ms) | streamed (ms) | "
             "streamed / in memory (min–max) | layers read |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['width']} | {r['estimator'].replace('_', ' ')} | "
                     f"{r['layers_per_unit']} | {r['memory_ms']:.3g} | {r['streamed_ms']:.3g} | "
                     f"**{r['ratio']:.2f}** ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | "
                     f"{r['layers_read']:.0f} |")
    return "\n".join(lines)


def portable(argv: list[str]) -> str:
    """The command as a reader reruns it: file arguments by their names only."""
    out, after = [], None
    for a in argv:
        out.append(Path(a).name if after in ("--json", "--doc", "--from-json") and "/" in a
                   and not a.startswith("docs/") else a)
        after = a
    return " ".join(["python benchmarks/grouped_units.py", *out])


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--groups", type=int, nargs="+", default=list(GROUPS))
    p.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--doc", default=None, help="write the table into this doc's block")
    p.add_argument("--from-json", default=None, help="render an earlier run's JSON (no "
                   "measuring)")
    args = p.parse_args(argv)
    if min(args.widths + args.groups) < 1 or args.rounds < 1:
        p.error("--widths, --groups and --rounds must be positive")
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        rows, command = saved["rows"], saved["command"]
    else:
        rows = measure(args.widths, args.groups, args.estimators, args.rounds)
        command = portable(argv if argv is not None else sys.argv[1:])
    table = markdown(rows)
    print(table)
    if args.json and not args.from_json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows, "machine": (
            f"{platform.platform()}, {jax.devices()[0].platform}")}, indent=1))
    if args.doc:
        from jaxstream.experiment.docblock import write_tables

        if not write_tables(args.doc, "grouped_units.py", {"table": table}, command.strip()):
            raise SystemExit(f"error: {args.doc} has no <!-- generated: grouped_units.py table "
                             "--> block; add the marker pair where the table belongs")
    return rows


if __name__ == "__main__":
    main()
