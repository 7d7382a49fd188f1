"""Matplotlib figures of gradient-quality rows (per layer, sweeps, settings side by side).

Every function takes plain rows (dicts, as in :class:`~jaxstream.quality.table.QualityTable`)
and returns a ``Figure``; the caller saves it (``fig.savefig(path)``) or shows it. Each series
has its own marker and line style and is shifted slightly along x, so estimators that give the
same numbers (e.g. ``guess``, ``weighted`` and the exact subset when the forward part is shrunk
away) stay visible; a note in the panel names the series that coincide. Axes are labelled in
words (:data:`LABELS`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use(matplotlib.get_backend())  # keep the user's backend; Agg in tests and scripts
import matplotlib.pyplot as plt

from jaxstream.quality.groups import WHOLE

Rows = Sequence[Mapping[str, Any]]

#: Words for the fields used as axes.
LABELS = {
    "cosine_mean": "cosine to exact gradient",
    "cosine_std": "std of cosine over seeds",
    "norm_ratio_mean": "norm ratio |est| / |exact|",
    "relative_error_mean": "relative error",
    "relative_variance": "relative variance (var / |exact|²)",
    "bias": "bias |mean - exact| / |exact|",
    "snr": "signal-to-noise |exact|² / var",
    "num_tangents": "tangents per micro-batch K",
    "num_exact": "micro-batches with an exact gradient",
    "group": "layer group",
}
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_STYLES = ("-", "--", "-.", ":")


def label(field: str) -> str:
    """The words for an axis field (the field name itself if unknown)."""
    return LABELS.get(field, field.replace("_", " "))


def _style(i: int) -> dict[str, Any]:
    return {"marker": _MARKERS[i % len(_MARKERS)], "ls": _STYLES[(i // 2) % len(_STYLES)],
            "capsize": 3, "markersize": 5}


def legend_beside(ax: Any, **kw: Any) -> Any:
    """``ax``'s legend right of the axes, outside the data, so it covers no point or error bar
    whatever the curves' shape (``fig.tight_layout()`` or ``bbox_inches="tight"`` keep it in
    the saved figure); ``kw`` override the placement. Call it again after adding lines.

    Example:
      >>> ax.axhline(0.01, label="theory"); legend_beside(ax); fig.tight_layout()
    """
    opts = {"fontsize": "small", "loc": "upper left", "bbox_to_anchor": (1.01, 1.0),
            "frameon": False, **kw}
    return ax.legend(**opts)


def _note_coinciding(ax: Any, curves: Mapping[str, Sequence[float]]) -> None:
    """Add "lines coincide: a = b" (equal to 3 significant digits) under the panel's title."""
    groups: dict[tuple, list[str]] = {}
    for name, ys in curves.items():
        groups.setdefault(tuple(float(f"{float(y):.3g}") for y in ys), []).append(str(name))
    same = [g for g in groups.values() if len(g) > 1]
    if same:
        ax.text(0.5, 0.98, "lines coincide: " + "; ".join(" = ".join(g) for g in same),
                transform=ax.transAxes, fontsize=7, color="dimgray", va="top", ha="center",
                bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})


def _shift(i: int, n: int, width: float = 0.25) -> float:
    """Offset of series ``i`` of ``n`` along x (fraction of one step) so bars do not overlap."""
    return 0.0 if n < 2 else (i - (n - 1) / 2) * width / (n - 1)


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
    names = _unique(rows, "estimator")
    curves = {}
    for i, name in enumerate(names):
        sel = {r["group"]: r for r in rows if r["estimator"] == name}
        y = [sel[g][metric] for g in groups]
        err = [sel[g][spread] for g in groups] if spread else None
        xs = [j + _shift(i, len(names)) for j in range(len(groups))]
        ax.errorbar(xs, y, yerr=err, label=name, **_style(i))
        curves[name] = y
    _note_coinciding(ax, curves)
    ax.set_xticks(range(len(groups)), groups, rotation=45, ha="right")
    ax.set_xlabel(label("group"))
    ax.set_ylabel(label(metric))
    ax.set_title(f"{label(metric).split(' (')[0]} per layer")
    if metric.startswith("relative_variance") or metric == "snr":
        ax.set_yscale("log")
    legend_beside(ax)
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
            names = _unique(sub, series)
            log_x = x in ("num_tangents",)
            curves, ticks = {}, set()
            for k, name in enumerate(names):
                pts = sorted((r for r in sub if r[series] == name), key=lambda r: r[x])
                xs = [r[x] for r in pts]
                ticks.update(xs)
                ys = [r[metric] for r in pts]
                err = [r[spread] for r in pts] if spread else None
                d = _shift(k, len(names), 0.15 if log_x else 0.25)
                xs = [v * 2.0**d for v in xs] if log_x else [v + d for v in xs]
                ax.errorbar(xs, ys, yerr=err, label=str(name), **_style(k))
                curves[str(name)] = ys
            _note_coinciding(ax, curves)
            ax.set_xlabel(label(x))
            ax.set_ylabel(label(metric))
            ax.set_title(f"{col}")
            if metric in log_metrics:
                ax.set_yscale("log")
            if log_x:
                ax.set_xscale("log", base=2)
            ax.minorticks_off()
            ax.set_xticks(sorted(ticks), [str(t) for t in sorted(ticks)])  # counts: integers
    legend_beside(axes[0][-1])
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
    ax.set_ylabel(label(metric))
    ax.set_title(title)
    legend_beside(ax)
    fig.tight_layout()
    return fig
