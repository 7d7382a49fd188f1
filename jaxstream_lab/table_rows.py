"""A forward table's rows as the report reads them: the judged figure of a row (test error, or
test loss for a data set judged by loss), baselines, and Ren et al.'s published figures beside
the arms that ran their design (data with its source: ``published.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

# Ren et al.'s published figures are data, with their source: published.json beside this file
_PUBLISHED = json.loads((Path(__file__).with_name("published.json")).read_text())["ren2023"]
REN_SETTINGS = tuple(_PUBLISHED["settings"])
REN_MNIST = _PUBLISHED["mnist_test_error_percent"]
REN = "-Ren"  # suffix of the arms that run Ren et al.'s local losses (a head per block)
FORWARD_ARMS = ("FG-W", "FG-A", "LG-FG-W", "LG-FG-A", "LG-FG-W" + REN, "LG-FG-A" + REN)
#: The arms :func:`jaxstream_lab.table_plots.equivalents_plot` draws where a table has them (the rest: the table).
MAIN_ARMS = ("BP", "FG-W", "FG-A", "FG-A-K16", "LG-FG-A", "LG-FG-A" + REN,
             "LG-FG-A" + REN + "-P16G4-agg", "local-guess",
             "exact-subset", "hybrid-control_variate", "hybrid-weighted", "hybrid-activity")


def ren_figures(row: dict) -> dict:
    """Ren et al.'s published figures for a row's method: by arm name, beside MLP rows only
    (their figures are of MLPs), the local-loss arms only where the row ran their design (its
    own head per block: ``local_heads == "own"``) and only in the setting whose groups it ran
    (S/1/1: one group; M/1/16: 16)."""
    name = row["arm"]
    if row.get("model", "mlp") != "mlp":
        return {}  # their figures are of MLPs
    if not name.startswith("LG-"):
        return REN_MNIST.get(name, {})
    if row.get("local_heads") != "own" or row.get("local_over", "features") != "features":
        return {}  # not their design, or patch-wise groups (their MLP rows group features)
    figures = REN_MNIST.get(name.split(REN)[0], {})
    groups = row.get("local_groups", 1)
    return {s: v for s, v in figures.items() if int(s.rsplit("/", 1)[1]) == groups}


def markdown_table(lines: list[dict[str, str]]) -> str:
    """A Markdown table of one ``{column: cell}`` dict per line (pandas' ``to_markdown``; the
    cells are written as given, strings that look like numbers included)."""
    return pd.DataFrame(lines).to_markdown(index=False, disable_numparse=True)


def _pm(mean: float, sd: float, scale: float = 100.0) -> str:
    return f"{scale * mean:.2f} ± {scale * sd:.2f}"


def _fmt(x: Any, spec: str = ".0f") -> str:
    return "—" if x is None else format(x, spec)


def is_baseline(r: dict) -> bool:
    """A baseline row (:mod:`jaxstream_lab.table_baselines`): one figure, no training."""
    return r.get("kind") == "baseline"


def _by(rows: list[dict], dataset: str) -> dict[str, dict]:
    return {r["arm"]: r for r in rows if r["dataset"] == dataset}


def _is_loss(r: dict) -> bool:
    return r.get("metric", "error") == "loss"


def _m(r: dict) -> tuple[float, float]:
    """The row's judged figure (test error, or test loss for ``metric: loss``): mean, sd."""
    if _is_loss(r):
        return r["test_loss_mean"], r.get("test_loss_sd", 0.0)
    return r["test_error_mean"], r["test_error_sd"]


def _d(x: float, loss: bool) -> str:
    """A difference of the judged figure: nats for losses, percentage points for errors."""
    return f"{x:+.3f}" if loss else f"{100 * x:+.2f} pp"


def _show(r: dict) -> str:
    mean, sd = _m(r)
    return f"{mean:.3f} ± {sd:.3f}" if _is_loss(r) else f"{_pm(mean, sd)} %"
