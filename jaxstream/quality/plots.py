"""Matplotlib figures of gradient-quality rows (per layer, sweeps, settings side by side).

Every function takes plain rows (dicts, as in :class:`~jaxstream.quality.table.QualityTable`)
and returns a ``Figure``; the caller saves it (``fig.savefig(path)``) or shows it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use(matplotlib.get_backend())  # keep the user's backend; Agg in tests and scripts
import matplotlib.pyplot as plt

from jaxstream.quality.groups import WHOLE

Rows = Sequence[Mapping[str, Any]]


def _unique(rows: Rows, key: str) -> list[Any]:
    return list(dict.fromkeys(r[key] for r in rows))


def plot_per_layer(
    rows: Rows, metric: str = "cosine_mean", spread: str | None = "cosine_std", ax: Any = None
):
    """One line per estimator: ``metric`` against layer group (``all`` excluded), with error bars.

    Example:
      >>> fig = plot_per_layer(table.rows)
    """
    fig, ax = (ax.figure, ax) if ax is not None else plt.subplots(figsize=(7, 3.5))
    groups = [g for g in _unique(rows, "group") if g != WHOLE] or [WHOLE]
    for name in _unique(rows, "estimator"):
        sel = {r["group"]: r for r in rows if r["estimator"] == name}
        y = [sel[g][metric] for g in groups]
        err = [sel[g][spread] for g in groups] if spread else None
        ax.errorbar(range(len(groups)), y, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xticks(range(len(groups)), groups, rotation=45, ha="right")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per layer")
    if metric.startswith("relative_variance") or metric == "snr":
        ax.set_yscale("log")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_sweep(
    rows: Rows,
    x: str,
    metrics: Sequence[tuple[str, str | None]] = (("cosine_mean", "cosine_std"),),
    series: str = "estimator",
    panels: str = "setting",
    log_metrics: Sequence[str] = ("relative_variance", "snr"),
):
    """Grid of panels (``metrics`` rows x ``panels`` values): each ``series`` against ``x``.

    Args:
      rows: rows holding ``x``, ``series``, ``panels`` and the metric keys (one group).
      x: the swept key (e.g. ``num_tangents``).
      metrics: ``(metric, spread or None)`` pairs, one row of panels each.
      series: key of the lines.
      panels: key of the columns of panels.
      log_metrics: metrics drawn on a log y axis.

    Example:
      >>> fig = plot_sweep(rows, x="num_tangents", metrics=[("cosine_mean", "cosine_std")])
    """
    cols = _unique(rows, panels)
    fig, axes = plt.subplots(
        len(metrics), len(cols), figsize=(4.5 * len(cols), 3.2 * len(metrics)), squeeze=False
    )
    for i, (metric, spread) in enumerate(metrics):
        for j, col in enumerate(cols):
            ax = axes[i][j]
            sub = [r for r in rows if r[panels] == col]
            for name in _unique(sub, series):
                pts = sorted((r for r in sub if r[series] == name), key=lambda r: r[x])
                xs = [r[x] for r in pts]
                ys = [r[metric] for r in pts]
                err = [r[spread] for r in pts] if spread else None
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, label=str(name))
            ax.set_xlabel(x)
            ax.set_ylabel(metric)
            ax.set_title(f"{col}")
            if metric in log_metrics:
                ax.set_yscale("log")
            if x in ("num_tangents",):
                ax.set_xscale("log", base=2)
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_settings_bars(
    rows: Rows,
    metric: str = "cosine_mean",
    spread: str = "cosine_std",
    series: str = "estimator",
    settings: str = "setting",
    title: str = "",
):
    """Grouped bars: one group per ``series`` value, one bar per ``settings`` value, error bars.

    Example:
      >>> fig = plot_settings_bars(headline_rows, title="N=16, 2 exact")
    """
    names = _unique(rows, series)
    sets = _unique(rows, settings)
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 3.8))
    width = 0.8 / max(len(sets), 1)
    for j, s in enumerate(sets):
        sel = {r[series]: r for r in rows if r[settings] == s}
        xs = [i + (j - (len(sets) - 1) / 2) * width for i in range(len(names))]
        ax.bar(
            xs,
            [sel[n][metric] for n in names],
            width,
            yerr=[sel[n][spread] for n in names],
            capsize=3,
            label=str(s),
        )
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
