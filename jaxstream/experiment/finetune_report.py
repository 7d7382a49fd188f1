"""Tables of a ``kind: finetune`` run, from its ``finetune.json`` (and ``env.json``).

Example::

    python -m jaxstream.experiment.finetune_report runs/finetune_stream/run-001
    python -m jaxstream.experiment.finetune_report RUN --doc docs/finetune.md   # its blocks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCRIPT = "finetune_report"


def _mb(x: float | None) -> str:
    return "–" if x is None else f"{x / 1e6:.1f} MB"


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "–" if x is None else format(x, fmt)


def model_line(s: dict[str, Any]) -> str:
    """The model, the process constant, the raw bandwidth and the pretraining in one line."""
    m, p = s["model"], s["pretrain"]
    const = s.get("rss_constant")
    return (f"Model: {m['params'] / 1e6:.1f} M parameters, {_mb(m['fp32_bytes'])} fp32 "
            f"({m['num_blocks']} blocks of {_mb(m['block_bytes'])}); process RSS once JAX has "
            f"started {_mb(const)}; raw read bandwidth (`jaxstream plan`'s cold 64 MiB read in "
            f"the run directory) {s['raw_read_bandwidth'] / 1e9:.2f} GB/s; pretraining "
            f"{p['steps']} backprop steps in memory: train loss {p['loss_start']:.3f} → "
            f"{p['loss_end']:.3f}. Run time {s['run_time'] / 60:.1f} min.")


def arms_table(s: dict[str, Any]) -> str:
    """One row per arm: losses, bytes per step, bandwidth, model / budget, peak RSS."""
    m, raw = s["model"], s["raw_read_bandwidth"]
    head = ("| arm | engine | estimator | train loss start → end | test loss end | "
            "read / step | written / step | model reads / step | block writes / step | "
            "step time | read bandwidth (× raw) | model / budget | RSS at start → peak of the steps "
            "((peak − start) / model) | peak of the compilation |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, a in s["arms"].items():
        e = a["engine_config"]
        engine = "in memory (fp32)" if "store" not in e else (
            f"stream {e['compute_dtype']}, {e['update']}"
            + (f", k={e['rewrite_every']}" if e.get("rewrite_every", 1) > 1 else "")
            + f", prefetch {e['prefetch']}")
        bw = a.get("read_bandwidth")
        ratio = "–" if a.get("budget_bytes") is None else (
            f"{m['fp32_bytes'] / a['budget_bytes']:.0f}× ({_mb(a['budget_bytes'])})")
        peak = a.get("rss_peak")
        rows.append(
            f"| {name} | {engine} | {a['estimator']} | {_f(a['loss_start'])} → "
            f"{_f(a['loss_end'])} | {_f(a['test_loss_end'])} | {_mb(a.get('bytes_read'))} | "
            f"{_mb(a.get('bytes_written'))} | {_f(a.get('model_reads_per_step'), '.2f')} | "
            f"{_f(a.get('block_writes_per_step'), '.2f')} | {_f(a['step_time'], '.1f')} s | "
            + ("–" if bw is None else f"{bw / 1e9:.2f} GB/s ({bw / raw:.2f}×)")
            + f" | {ratio} | "
            + ("–" if peak is None else f"{_mb(a['rss_start'])} → {_mb(peak)} "
                                          f"({(peak - a['rss_start']) / m['fp32_bytes']:.2f}×)")
            + f" | {_mb(a.get('rss_warm_up'))} |")
    return "\n".join(rows)


def loss_table(s: dict[str, Any]) -> str:
    """The training loss of each step (the batch's loss at the parameters it updates)."""
    names = list(s["arms"])
    n = max(len(a["step_losses"]) for a in s["arms"].values())
    rows = ["| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for t in range(n):
        cells = [_f(a["step_losses"][t]) if t < len(a["step_losses"]) else "–"
                 for a in s["arms"].values()]
        rows.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def format_tables(s: dict[str, Any]) -> str:
    """Everything for a terminal: the model line and both tables."""
    return f"{model_line(s)}\n\n{arms_table(s)}\n\n{loss_table(s)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="a finetune run directory (holds finetune.json)")
    p.add_argument("--doc", default=None, help=f"rewrite the <!-- generated: {SCRIPT} NAME --> "
                   "blocks (model, table, losses) of this doc")
    args = p.parse_args(argv)
    run = Path(args.run)
    if not (run / "finetune.json").is_file():
        print(f"error: {run}/finetune.json is missing: not a finished finetune run",
              file=sys.stderr)
        return 2
    s = json.loads((run / "finetune.json").read_text())
    if args.doc is None:
        print(format_tables(s))
        return 0
    from jaxstream.experiment.docblock import machine, write_tables

    env = json.loads((run / "env.json").read_text()) if (run / "env.json").is_file() else None
    tables = {"model": model_line(s), "table": arms_table(s), "losses": loss_table(s)}
    cmd = f"python -m jaxstream.experiment.{SCRIPT} {args.run} --doc {args.doc}"
    try:
        written = write_tables(args.doc, SCRIPT, tables, cmd, where=machine(env) if env else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"error: {args.doc} has no <!-- generated: {SCRIPT} table --> block",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
