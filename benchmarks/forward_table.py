"""Ren et al.'s forward-gradient table, reproduced: every arm trained on every data set.

The table itself is :mod:`jaxstream_lab.forward_table` (also ``jaxstream run
experiments/forward_table.yaml``); this script runs it, writes the rows as JSON, the markdown
report (docs/results.md) and the memory/time frontier plot.

Usage:
  python benchmarks/forward_table.py --quick --json table.json        # < 10 min on 2 cores
  python benchmarks/forward_table.py --config experiments/forward_table.yaml --json full.json \
      --plot docs/forward_table_frontier.png --docs docs/results.md
  python benchmarks/forward_table.py --from-json full.json --docs docs/results.md --plot f.png
  python benchmarks/forward_table.py --from-json a.json b.json --docs r.md   # several runs
  python benchmarks/forward_table.py --config experiments/budget_table.yaml --json b.json \
      --budget-docs docs/budget_table.md --budget-plot docs/budget_table.png

``--json PATH`` writes the list of rows (keys include dataset, arm, test_error_mean,
test_error_sd, train_error_mean, seeds, peak_temp_bytes, cosine_mean) and ``PATH.meta`` the
command, config, machine and wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jaxstream.experiment  # noqa: F401  (registers data, model and estimator choices)
from jaxstream.experiment.config import to_dict
from jaxstream.experiment.docblock import machine
from jaxstream_lab import budget_report
from jaxstream_lab.budget_doc import document
from jaxstream_lab.forward_table import run_table
from jaxstream_lab.table_config import ROW_KEYS, load_table_config
from jaxstream_lab.table_plots import equivalents_plot, frontier_plot, plot_arms
from jaxstream_lab.table_report import markdown

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "experiments" / "forward_table_quick.yaml"
FULL = ROOT / "experiments" / "forward_table.yaml"
__all__ = ["FULL", "QUICK", "ROW_KEYS", "load_table_config", "main"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=str, default=None, help=f"table YAML (default {FULL.name})")
    parser.add_argument("--quick", action="store_true", help=f"use {QUICK.name}")
    parser.add_argument("--set", nargs="*", default=[], help="dotted overrides, e.g. seeds=5")
    parser.add_argument("--datasets", nargs="*", default=None)
    parser.add_argument("--arms", nargs="*", default=None)
    parser.add_argument("--json", type=str, default=None, help="write the rows here")
    parser.add_argument("--from-json", nargs="+", default=None,
                        help="reuse rows of one or more runs (each with its PATH.meta), no training")
    parser.add_argument("--plot", type=str, default=None, help="frontier plot (PNG)")
    parser.add_argument("--cost-plot", type=str, default=None,
                        help="test error against forward-pass equivalents (PNG)")
    parser.add_argument("--docs", type=str, default=None, help="write a markdown report here")
    parser.add_argument("--budget-docs", type=str, default=None,
                        help="write the equal-budget document (jaxstream_lab.budget_doc) here")
    parser.add_argument("--budget-plot", type=str, default=None,
                        help="test error against forward passes per family (PNG)")
    parser.add_argument("--memory-json", type=str, default=None,
                        help="add a memory_time.py --json output (and its .meta) to the report")
    args = parser.parse_args(argv)
    command = "python benchmarks/forward_table.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        runs = [{**json.loads(Path(f + ".meta").read_text()), "rows": json.loads(Path(f).read_text())}
                for f in args.from_json]
        payload = {**runs[0], "rows": [r for run in runs for r in run["rows"]]}
        if len(runs) > 1:
            payload["runs"] = runs
    else:
        path = args.config or (QUICK if args.quick else FULL)
        cfg = load_table_config(path, args.set)
        t0 = time.perf_counter()
        rows = run_table(cfg, args.datasets, args.arms)
        payload = {"command": command, "config": str(Path(path).name), "machine": machine(),
                   "seconds": time.perf_counter() - t0, "rows": rows,
                   "report": to_dict(cfg.report)}
        print(f"total {payload['seconds']:.0f} s")
    if args.json:  # the rows; the run's command, machine and time beside them in PATH.meta
        Path(args.json).write_text(json.dumps(payload["rows"], indent=1))
        meta = {k: v for k, v in payload.items() if k != "rows"}
        Path(args.json + ".meta").write_text(json.dumps(meta, indent=1))
    if args.plot:
        frontier_plot(payload["rows"], args.plot)
    cost = (args.cost_plot if args.cost_plot and equivalents_plot(
        payload["rows"], args.cost_plot, plot_arms(payload)) else None)
    memory = None
    if args.memory_json:
        meta = Path(args.memory_json + ".meta")
        memory = {**(json.loads(meta.read_text()) if meta.exists() else {}),
                  "rows": json.loads(Path(args.memory_json).read_text())}
    if args.docs:
        payload = {**payload, "report_command": command}
        Path(args.docs).write_text(markdown(payload, args.plot, memory, cost))
    budget_plot = (args.budget_plot if args.budget_plot
                   and budget_report.plot(payload["rows"], args.budget_plot) else None)
    if args.budget_docs:
        payload = {**payload, "report_command": command}
        Path(args.budget_docs).write_text(document(payload, budget_plot))
    return payload["rows"]


if __name__ == "__main__":
    main()
