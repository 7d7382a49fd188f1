"""A forward table's rows as the report reads them: the judged figure of a row (test error, or
test loss for a data set judged by loss), baselines, and Ren et al.'s published figures beside
the arms that ran their design (data with its source: ``published.json``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from jaxstream.experiment.config import from_dict
from jaxstream_lab.table_config import TableReport, load_table_config

# Ren et al.'s published figures and claims are data, with their source: published.json
_PUBLISHED = json.loads((Path(__file__).with_name("published.json")).read_text())["ren2023"]
REN_SETTINGS = tuple(_PUBLISHED["settings"])
REN_MNIST = _PUBLISHED["mnist_test_error_percent"]
PUBLISHED_METHODS = tuple(REN_MNIST)
#: Ren et al.'s claimed ordering of their methods: ``claim``, ``relations`` (``a``, ``b``,
#: the sentence ``said``, the verdicts of ``a − b`` that answer ``yes`` / ``no``), ``best``,
#: ``worst``.
REN_ORDERING = _PUBLISHED["ordering"]
REN_COLUMNS = _PUBLISHED["columns"]  # what the published columns are, for the report


def method_of(arm: str, report: TableReport) -> str | None:
    """The published method ``arm`` runs (``report.methods``), None if none."""
    return next((m for m, arms in report.methods.items() if arm in arms), None)


def ren_figures(row: dict, report: TableReport) -> dict:
    """Ren et al.'s published figures for a row's method (``report.methods``), beside MLP rows
    only (their figures are of MLPs); a local-loss method's only where the row ran their design
    (its own head per block: ``local_heads == "own"``, groups of features) and only in the
    setting whose groups it ran (S/1/1: one group; M/1/16: 16)."""
    method = method_of(row["arm"], report)
    if method is None or row.get("model", "mlp") != "mlp":
        return {}  # not a published method, or not an MLP (their figures are of MLPs)
    figures = REN_MNIST[method]
    if method not in _PUBLISHED["local_methods"]:
        return figures
    if row.get("local_heads") != "own" or row.get("local_over", "features") != "features":
        return {}  # not their design, or patch-wise groups (their MLP rows group features)
    groups = row.get("local_groups", 1)
    return {s: v for s, v in figures.items() if int(s.rsplit("/", 1)[1]) == groups}


def report_roles(payload: dict) -> dict[str, TableReport]:
    """Each data set's :class:`TableReport`, from the run that wrote its rows: its
    ``report`` (written beside the rows since runs record it), else the ``report:`` section
    of the config its command names (``--config PATH``), else an empty one (no part of the
    report that needs roles is written)."""
    out = {}
    for run in payload.get("runs") or [payload]:
        report = run.get("report")
        if report is None:
            words = str(run.get("command", "")).split()
            path = words[words.index("--config") + 1] if "--config" in words[:-1] else None
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(
                    f"report: the run `{run.get('command')}` predates its rows' report section "
                    f"and its config {path} is not found from {Path.cwd()}; run this from where "
                    "that command ran (the repository root), or add its report section to the "
                    "rows' .meta")
            roles = load_table_config(path).report if path else TableReport()
        else:
            roles = from_dict(TableReport, report, "report")
        for r in run.get("rows", payload["rows"]):
            out.setdefault(r["dataset"], roles)
    return out


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
