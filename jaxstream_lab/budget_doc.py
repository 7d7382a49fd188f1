"""The equal-budget table as a document of its own (docs/budget_table.md): the run, the rules,
and per data set the budget section (:mod:`jaxstream_lab.budget_report`), the sweeps' edges and
the picks' stability."""

from __future__ import annotations

import os

from jaxstream_lab import budget_report
from jaxstream_lab.stability import flagged
from jaxstream_lab.table_report import _edges, _run_lines
from jaxstream_lab.table_rows import is_baseline
from jaxstream_lab.table_verdicts import (
    ALPHA,
    MARGIN_ERROR,
    MARGIN_LOSS,
    MIN_SEEDS,
    MIN_SEEDS_EQUIVALENT,
    VERDICT_RULES,
)


def document(payload: dict, plot: str | None = None) -> str:
    """The whole document from a run's payload (``rows``, ``command``, ``machine``, ...)."""
    every = payload["rows"]
    rows = [r for r in every if not is_baseline(r)]
    datasets = [d for d in dict.fromkeys(r["dataset"] for r in rows)
                if budget_report.budgets(rows, d)]
    parts = ["# Forward-mode against zeroth-order and low-rank directions, at an equal budget",
             "", "Written by a command from run outputs; do not edit by hand.", "",
             f"- report written by: `{payload.get('report_command', payload.get('command'))}`"]
    parts += _run_lines(payload, rows)
    rules = VERDICT_RULES.format(alpha=ALPHA, pp=100 * MARGIN_ERROR, nats=MARGIN_LOSS,
                                 five=MIN_SEEDS_EQUIVALENT, three=MIN_SEEDS)
    parts += ["", budget_report.INTRO, "", rules.replace(
        "every paired comparison of the data set's table (the family; its size is stated per "
        "table)", "the paired comparisons of one K (the family; its size is stated per table)"),
        "", ("Rates are picked on a validation split held out of the training set where the data "
             "set has one (the arms train on the rest), else on the final train error.")]
    if plot:
        parts += ["", f"![budget]({os.path.basename(plot)})", "",
                  budget_report.PLOT_CAPTION]
    for ds in datasets:
        r0 = next(r for r in rows if r["dataset"] == ds)
        parts += ["", f"## {ds}", "", (f"{r0['steps']} steps, {r0['seeds']} seeds, rates picked "
                  f"on the {r0.get('picked_on', 'train')} split."), "",
                  budget_report.section(rows, ds), "", _edges(rows, ds)]
        said = flagged(every, ds)
        if said:
            parts += ["", said]
    return "\n".join(parts) + "\n"
