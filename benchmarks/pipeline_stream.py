"""``experiments/pipeline_stream.yaml`` under each schedule of the composed engine, one run:
test loss against pipeline ticks for every arm beside GPipe backprop, before (the chunked
schedule: one GPipe pass per chunk of layers) and after (the circular schedule, and with each
update deferred to the layer's next read).

    python benchmarks/pipeline_stream.py --json out.json --plot out.png [--steps 150]
    python benchmarks/pipeline_stream.py --quick               # 30 steps, evaluated every 10
    python benchmarks/pipeline_stream.py --doc docs/composed.md --doc-from out.json

Per (configuration, arm): ticks and layer reads per step (counted by the engine), the test
loss at the smallest arm-and-configuration's total ticks and at the end, and the step's time
on the critical path per cause (medians: waiting for a read, the host optimizer, a write).
Ticks and reads do not depend on the machine; the seconds do (simulated CPU devices here).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from jaxstream.experiment.docblock import machine, write_tables
from jaxstream.experiment.rundir import MetricsLog
from jaxstream.experiment.runner import run_experiment

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "experiments" / "pipeline_stream.yaml"
CONFIGS = {  # name: overrides
    "chunked (before)": ["engine.schedule=chunked"],
    "circular": [],
    "circular, update: lazy": ["engine.update=lazy"],
}
IDLE = {"idle_read_s": "stall_time", "idle_update_s": "update_wait_time",
        "idle_write_s": "write_wait_time"}


def curves(records: list[dict]) -> dict[str, dict]:
    """Per arm: cumulative ticks at each evaluation with its test loss, and per-step medians."""
    out: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in records):
        rs = sorted((r for r in records if r["arm"] == arm), key=lambda r: r["step"])
        total, points, steps = 0.0, [], [r for r in rs if "ticks" in r]
        for r in rs:
            total += r.get("ticks", 0.0)
            if "test_loss" in r:
                points.append((total, float(r["test_loss"]), float(r["test_accuracy"])))
        out[arm] = {"points": points,
                    "ticks_per_step": float(np.median([r["ticks"] for r in steps])),
                    "layers_read_per_step": float(np.median([r["layers_read"] for r in steps])),
                    "step_s": float(np.median([r["step_time"] for r in steps[1:]])),
                    **{k: float(np.median([r.get(v, 0.0) for r in steps[1:]]))
                       for k, v in IDLE.items()}}
    return out


def run(steps: int, eval_every: int) -> dict:
    results = {}
    for name, overrides in CONFIGS.items():
        print(f"{name}:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            run_dir, _ = run_experiment(CONFIG, [*overrides, f"steps={steps}",
                                                 f"eval_every={eval_every}",
                                                 f"checkpoint_every={steps}"],
                                        out=Path(tmp) / "run")
            results[name] = curves(MetricsLog(run_dir / "metrics.jsonl").read())
    return results


def at(points: list, budget: float) -> float | None:
    """The test loss at the last evaluation within ``budget`` ticks."""
    within = [p for p in points if p[0] <= budget + 1e-9]
    return within[-1][1] if within else None


def table(results: dict) -> str:
    budget = min(a["points"][-1][0] for c in results.values() for a in c.values())
    cols = ["configuration", "arm", "ticks / step", "layer reads / step",
            f"test loss at {budget:.0f} ticks", "final test loss", "ticks at the end",
            "step s", "idle read s", "idle update s", "idle write s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, arms in results.items():
        for arm, a in arms.items():
            vals = [name, arm, f"{a['ticks_per_step']:.0f}", f"{a['layers_read_per_step']:.0f}",
                    f"{at(a['points'], budget):.3f}", f"{a['points'][-1][1]:.3f}",
                    f"{a['points'][-1][0]:.0f}", f"{a['step_s']:.3f}",
                    *(f"{a[k]:.3f}" for k in IDLE)]
            lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    styles = dict(zip(results, ("--", "-", ":")))
    colors: dict = {}
    for name, arms in results.items():
        for arm, a in arms.items():
            c = colors.setdefault(arm, f"C{len(colors)}")
            t, loss, _ = zip(*a["points"])
            ax.plot(t, loss, styles[name], color=c, label=f"{arm} — {name}")
    ax.set(xlabel="pipeline ticks (summed over steps)", ylabel="test loss",
           title="pipeline_stream.yaml: test loss against ticks, per schedule")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="30 steps, evaluated every 10")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--doc", type=Path, help="rewrite the pipeline_stream.py block of this doc")
    ap.add_argument("--doc-from", type=Path, metavar="JSON", help="with --doc: from a --json")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every = 30, 10
    if args.doc_from:
        run_ = json.loads(args.doc_from.read_text())
        write_tables(args.doc, "pipeline_stream.py", {"table": table(run_["results"])},
                     f"{run_['command']} --json {args.doc_from.name}", where=run_["machine"])
        print(f"wrote {args.doc}")
        return 0
    results = run(args.steps, args.eval_every)
    print(table(results))
    command = f"python benchmarks/pipeline_stream.py --steps {args.steps}"
    if args.json:
        args.json.write_text(json.dumps({"results": results, "command": command,
                                         "machine": machine()}, indent=1))
    if args.plot:
        plot(results, args.plot)
    if args.doc:
        write_tables(args.doc, "pipeline_stream.py", {"table": table(results)}, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
