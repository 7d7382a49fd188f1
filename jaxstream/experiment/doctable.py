"""Result tables written from run directories, never by hand: for the terminal and for docs/.

``jaxstream compare RUN_DIR...`` prints the arms of train runs side by side and writes one plot.
Docs mark each generated table with the command that writes it (`docblock`)::

    <!-- generated: compare runs/quickstart -->
    ... (replaced) ...
    <!-- end generated -->

and ``python -m jaxstream.experiment.doctable docs/experiments.md`` rewrites every marked block
from the run directories it names (``compare RUN...`` for train runs, ``sweep RUN`` for an
``lr_sweep`` run, ``ticks RUN`` for a pipelined run's arms at equal pipeline ticks). Each
table ends with a line naming the command, the run's config and the machine it ran on (from its
``env.json``).

Example:
    >>> print(compare_runs(["runs/quickstart"], plot=None))
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxstream.experiment.config_yaml import ConfigError
from jaxstream.experiment.docblock import machine, rewrite
from jaxstream.experiment.rundir import MetricsLog
from jaxstream.experiment.summary import format_table


def read_run(run_dir: str | Path) -> dict[str, Any]:
    """``summary.json``, ``env.json`` and ``metrics.jsonl`` of a run directory."""
    d = Path(run_dir)
    out: dict[str, Any] = {"dir": d, "records": MetricsLog(d / "metrics.jsonl").read()}
    for name in ("summary", "env"):
        out[name] = _read_json(d / f"{name}.json")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file ({} if absent); one that is not readable JSON is a ConfigError."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


#: Run kinds ``compare`` compares (their summaries have the figures of the table).
COMPARED_KINDS = ("train",)


def run_kind(run: dict[str, Any]) -> str:
    """The run's ``kind`` from its config.yaml; without one, "train" if every arm has the
    compared figures, else "unknown"."""
    path = run["dir"] / "config.yaml"
    if path.is_file():
        import yaml

        try:
            kind = (yaml.safe_load(path.read_text()) or {}).get("kind")
        except (yaml.YAMLError, UnicodeDecodeError, AttributeError):
            kind = None
        if isinstance(kind, str):
            return kind
    arms = run["summary"].get("arms", {})
    return "train" if all("final_loss" in a for a in arms.values()) else "unknown"


def check_comparable(run: dict[str, Any]) -> None:
    """Refuse (one line) a run whose kind ``compare`` does not compare, or whose summary.json
    is missing (the run did not finish) or has no arms: its rows would be left out silently."""
    check_summary(run)
    kind = run_kind(run)
    if kind not in COMPARED_KINDS:
        raise ConfigError(f"{run['dir']}: a {kind!r} run; compare compares "
                          f"{' and '.join(repr(k) for k in COMPARED_KINDS)} runs only")


def check_summary(run: dict[str, Any]) -> None:
    """Refuse (one line) a run without summary.json or whose summary has no arms."""
    path = run["dir"] / "summary.json"
    if not path.is_file():
        config = run["env"].get("config") or "CONFIG"
        raise ConfigError(f"{run['dir']}: no summary.json: the run did not finish (killed or "
                          f"still running); finish it with `jaxstream run {config} --out "
                          f"{run['dir']} --resume`, or leave it out")
    if not isinstance(run["summary"].get("arms"), dict):
        raise ConfigError(f"{path}: has no \"arms\" (an object of each arm's figures); not "
                          "the summary of a finished train run")


def plot_path(plot: str | Path) -> Path:
    """The file the plot is written to: ``plot``, or ``plot.png`` without an extension; an
    extension matplotlib cannot write is a ConfigError naming those it can."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(plot)
    if not path.suffix:
        return path.with_name(path.name + ".png")
    allowed = sorted(FigureCanvasBase.get_supported_filetypes())
    if path.suffix[1:].lower() not in allowed:
        raise ConfigError(f"--plot {plot}: cannot write a {path.suffix!r} file; give one "
                          f"ending in {', '.join('.' + a for a in allowed)}")
    return path


def provenance(run: dict[str, Any], command: str) -> str:
    """The line under a generated table: command, config, overrides, machine."""
    env = run["env"]
    over = " ".join(env.get("overrides", []) or [])
    cfg = f"`jaxstream run {env.get('config', '?')}{' ' + over if over else ''}`"
    return (f"Written by `{command}` from `{run['dir']}` ({cfg}) on {machine(env)}.")


def _f(v: Any, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def _arms(runs: Sequence[dict[str, Any]]) -> dict[str, dict]:
    many = len(runs) > 1
    out = {}
    for run in runs:
        for name, a in run["summary"].get("arms", {}).items():
            out[f"{run['dir'].name}/{name}" if many else name] = a
    return out


def train_markdown(runs: Sequence[dict[str, Any]], target: float) -> str:
    """A Markdown table of the arms of train runs."""
    pct = format(target, ".0%")
    head = (f"| arm | estimator | lr | loss (last 10 steps) | test acc | steps to {pct} "
            f"| s to {pct} | ms/step | mean cosine |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for name, a in _arms(runs).items():
        lines.append(
            f"| {name} | {a.get('estimator', '')} | {_f(a.get('lr'), '.2g')} "
            f"| {_f(a.get('final_loss'), '.3f')} | {_f(a.get('final_test_accuracy'), '.3f')} "
            f"| {_f(a.get('steps_to_target'), 'd')} | {_f(a.get('seconds_to_target'), '.2f')} "
            f"| {_f(a.get('ms_per_step'), '.2f')} | {_f(a.get('mean_cosine'), '.3f')} |")
    return "\n".join(lines)


def sweep_markdown(run: dict[str, Any]) -> str:
    """A Markdown table of an ``lr_sweep`` run: steps to target / final accuracy per lr."""
    arms = run["summary"]["arms"]
    lrs = list(next(iter(arms.values()))["results"])
    lines = ["| estimator | " + " | ".join(f"{float(lr):.0e}" for lr in lrs) + " | picked |",
             "|---" * (len(lrs) + 2) + "|"]
    for name, a in arms.items():
        cells = []
        for lr in lrs:
            r = a["results"][lr]
            cell = f"{_f(r['steps_to_target'], 'd')} / {r['final_accuracy']:.3f}"
            cells.append(f"**{cell}**" if float(lr) == a["picked_lr"] else cell)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {a['picked_lr']:.0e} |")
    return "\n".join(lines)


def ticks_markdown(run: dict[str, Any]) -> str:
    """A Markdown table of a pipelined run's arms at equal pipeline ticks: each arm's test
    loss and accuracy at its last evaluation within the smallest arm's total ticks, and at
    its end (arms log ``ticks`` per step)."""
    per: dict[str, list[dict]] = {}
    for r in run["records"]:
        per.setdefault(r["arm"], []).append(r)
    rate = {a: next((r["ticks"] for r in rs if r.get("ticks")), None) for a, rs in per.items()}
    if any(v is None for v in rate.values()):
        raise ValueError(f"{run['dir']}: every arm must log 'ticks' (a pipelined engine)")
    steps = {a: max(r.get("step", 0) for r in rs) for a, rs in per.items()}
    budget = min(rate[a] * steps[a] for a in per)
    head = (f"| arm | ticks / step | test loss at {budget:.0f} ticks | test acc at {budget:.0f} "
            "ticks | final test loss | final test acc | ticks at the end | ms/step |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    arms = run["summary"].get("arms", {})
    for a, rs in per.items():
        ev = sorted((r for r in rs if r.get("test_loss") is not None), key=lambda r: r["step"])
        at = [r for r in ev if r["step"] * rate[a] <= budget][-1]
        lines.append(f"| {a} | {rate[a]:.0f} | {at['test_loss']:.3f} | "
                     f"{at['test_accuracy']:.3f} | {ev[-1]['test_loss']:.3f} | "
                     f"{ev[-1]['test_accuracy']:.3f} | {rate[a] * steps[a]:.0f} | "
                     f"{_f(arms.get(a, {}).get('ms_per_step'), '.0f')} |")
    return "\n".join(lines)


def compare_runs(run_dirs: Sequence[str | Path], plot: str | Path | None = "compare.png",
                 markdown: bool = False) -> str:
    """The arms of train runs side by side (text or Markdown); writes ``plot`` if given
    (``.png`` added without an extension)."""
    plot = None if plot is None else plot_path(plot)
    runs = [read_run(d) for d in run_dirs]
    for run in runs:
        check_comparable(run)
    target = runs[0]["summary"].get("target_accuracy", 0.95)
    if markdown:
        cmd = "jaxstream compare " + " ".join(str(d) for d in run_dirs) + " --markdown"
        text = train_markdown(runs, target) + "\n\n" + provenance(runs[0], cmd)
    else:
        text = format_table(_arms(runs), target)
    if plot is not None:
        from jaxstream.experiment.plots import write_compare_plot

        many = len(runs) > 1
        records = [{**r, "arm": f"{run['dir'].name}/{r['arm']}" if many else r["arm"]}
                   for run in runs for r in run["records"]]
        summary = runs[0]["summary"]  # the line the run's own plots drew (none for next-token
        line = summary.get("plotted_target", target)  # accuracy without a target of its own)
        write_compare_plot(records, list(_arms(runs)), plot, line)
        text += f"\nplot: {plot}"
    return text


KINDS = ("compare", "sweep", "ticks")


def generate(command: str, root: Path = Path(".")) -> str:
    """The Markdown written for one ``<!-- generated: COMMAND -->`` block."""
    words = command.split()
    what, dirs = words[0], [root / w for w in words[1:]]
    full = f"python -m jaxstream.experiment.doctable {command}"
    if what == "compare":
        runs = [read_run(d) for d in dirs]
        for run in runs:
            check_summary(run)
        target = runs[0]["summary"].get("target_accuracy", 0.95)
        return train_markdown(runs, target) + "\n\n" + provenance(runs[0], full)
    if what == "sweep":
        run = read_run(dirs[0])
        return sweep_markdown(run) + "\n\n" + provenance(run, full)
    if what == "ticks":
        run = read_run(dirs[0])
        return ticks_markdown(run) + "\n\n" + provenance(run, full)
    raise ValueError(f"generated block: {what!r} is not known; choose 'compare', 'sweep' or "
                     "'ticks'")


def update_doc(path: str | Path, root: Path = Path(".")) -> int:
    """Rewrite every run-table block of a Markdown file; returns the number of blocks."""
    return len(rewrite(path, lambda key: generate(key, root) if key.split()[0] in KINDS else None))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jaxstream.experiment.doctable DOC.md...`` or ``... compare|sweep RUN...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m jaxstream.experiment.doctable DOC.md... | compare RUN... | "
              "sweep RUN | ticks RUN", file=sys.stderr)
        return 2
    if argv[0] in ("compare", "sweep", "ticks"):
        print(generate(" ".join(argv)))
        return 0
    for doc in argv:
        print(f"{doc}: {update_doc(doc)} tables written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
