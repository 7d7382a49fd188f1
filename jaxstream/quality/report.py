"""Tables, verdicts and plots of the gradient-quality study, written into a run directory.

Files: ``quality.json`` / ``quality.csv`` (every row: setting, estimator, K, exact count, layer
group, statistics), ``headline.txt`` / ``headline.json`` (the configured N, exact count and K:
ingredients and corrections, correlated vs shuffled), and PNG plots: ``headline.png``,
``headline_per_layer.png``, ``vs_tangents.png``, ``vs_exact.png`` and per-layer sweeps
``vs_tangents_per_layer_<setting>.png``, ``vs_exact_per_layer_<setting>.png``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from jaxstream.quality.groups import WHOLE
from jaxstream.quality.plots import plot_per_layer, plot_settings_bars, plot_sweep
from jaxstream.quality.table import format_table, save_rows

FORWARD, SUBSET = "forward", "exact subset"
#: Relative cosine difference treated as a tie (float32 rounding).
TIE_TOLERANCE = 1e-5
Rows = list[dict[str, Any]]


def headline_rows(rows: Rows, cfg: Any, group: str = WHOLE) -> Rows:
    """Rows of the headline comparison (ingredients first, then corrections) for ``group``."""
    k, m = cfg.num_tangents, cfg.num_exact
    want = {(FORWARD, k, 0), (SUBSET, 0, m), *[(c, k, m) for c in cfg.corrections]}
    order = [FORWARD, SUBSET, *cfg.corrections]
    sel = [
        r
        for r in rows
        if r["group"] == group and (r["estimator"], r["num_tangents"], r["num_exact"]) in want
    ]
    return sorted(sel, key=lambda r: (r["setting"], order.index(r["estimator"])))


def verdicts(head: Rows, corrections: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per setting: is the best correction at least as close as the better ingredient?

    Compares mean cosines (a relative difference within ``TIE_TOLERANCE`` counts as a tie, so
    as close); the margin is also given in standard errors, treating the two as independent
    (conservative: both see the same keys and subsets).
    """
    out = {}
    for setting in dict.fromkeys(r["setting"] for r in head):
        by = {r["estimator"]: r for r in head if r["setting"] == setting}
        best = max(corrections, key=lambda c: by[c]["cosine_mean"])
        ingredient = max((FORWARD, SUBSET), key=lambda e: by[e]["cosine_mean"])
        b, i = by[best], by[ingredient]
        se = math.hypot(
            b["cosine_std"] / math.sqrt(b["num_seeds"]), i["cosine_std"] / math.sqrt(i["num_seeds"])
        )
        margin = b["cosine_mean"] - i["cosine_mean"]
        out[setting] = {
            "best_correction": best,
            "best_correction_cosine": b["cosine_mean"],
            "better_ingredient": ingredient,
            "better_ingredient_cosine": i["cosine_mean"],
            "margin": margin,
            "margin_in_standard_errors": margin / se if se > 0 else math.inf,
            # float32 rounding: `guess` has exactly the subset mean's direction, so ties are real
            "at_least_as_close": bool(margin >= -TIE_TOLERANCE * abs(i["cosine_mean"])),
        }
    return out


def _columns() -> list[tuple[str, str, str]]:
    return [
        ("setting", "setting", "{}"),
        ("estimator", "estimator", "{}"),
        ("num_tangents", "K", "{}"),
        ("num_exact", "exact", "{}"),
        ("cosine_mean", "cosine", "{:.4f}"),
        ("cosine_std", "+-std", "{:.4f}"),
        ("relative_error_mean", "rel.err", "{:.3g}"),
        ("bias", "bias", "{:.3g}"),
        ("relative_variance", "rel.var", "{:.3g}"),
        ("snr", "SNR", "{:.3g}"),
    ]


def _save(fig: Any, path: Path) -> str:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # legends sit beside the axes
    plt.close(fig)
    return path.name


def write_outputs(rows: Rows, cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Write every table and plot of the study into ``run_dir``; return the summary part."""
    save_rows(rows, run_dir / "quality.json")
    save_rows(rows, run_dir / "quality.csv")
    head = headline_rows(rows, cfg)
    verdict = verdicts(head, cfg.corrections)
    title = (
        f"N={cfg.micro_batches}, {cfg.num_exact} exact, K={cfg.num_tangents}: "
        "cosine to the exact batch gradient (+- std over seeds)"
    )
    lines = [title, format_table(head, _columns()), ""]
    for setting, v in verdict.items():
        word = "is" if v["at_least_as_close"] else "is NOT"
        lines.append(
            f"{setting}: best correction {v['best_correction']} ({v['best_correction_cosine']:.4f})"
            f" {word} at least as close as the better ingredient {v['better_ingredient']} "
            f"({v['better_ingredient_cosine']:.4f}); margin {v['margin']:+.4f} = "
            f"{v['margin_in_standard_errors']:+.1f} standard errors"
        )
    (run_dir / "headline.txt").write_text("\n".join(lines) + "\n")
    save_rows(head, run_dir / "headline.json")
    plots = [_save(plot_settings_bars(head, title=title), run_dir / "headline.png")]
    for setting in cfg.settings:
        layer_rows = [
            r
            for g in dict.fromkeys(r["group"] for r in rows)
            for r in headline_rows(rows, cfg, g)
            if r["setting"] == setting
        ]
        fig = plot_per_layer(layer_rows)
        fig.axes[0].set_title(f"cosine per layer, {setting}")
        plots.append(_save(fig, run_dir / f"headline_per_layer_{setting}.png"))
    metrics = (("cosine_mean", "cosine_std"), ("relative_variance", None))
    sweeps = {
        "tangents": ("num_tangents", [FORWARD, *cfg.corrections], "num_exact", cfg.num_exact),
        "exact": ("num_exact", [SUBSET, *cfg.corrections], "num_tangents", cfg.num_tangents),
    }
    for label, (x, names, fixed, value) in sweeps.items():
        sel = [
            r
            for r in rows
            if r["estimator"] in names
            and (r[fixed] == value or r["estimator"] in (FORWARD, SUBSET))
            and not (r["estimator"] == SUBSET and x == "num_tangents")
            and not (r["estimator"] == FORWARD and x == "num_exact")
        ]
        whole = [r for r in sel if r["group"] == WHOLE]
        plots.append(_save(plot_sweep(whole, x, metrics), run_dir / f"vs_{label}.png"))
        for setting in cfg.settings:
            per_layer = [r for r in sel if r["setting"] == setting]
            fig = plot_sweep(per_layer, x, metrics, panels="group")
            plots.append(_save(fig, run_dir / f"vs_{label}_per_layer_{setting}.png"))
    return {
        "headline": [
            {k: r[k] for k in ("setting", "estimator", "cosine_mean", "cosine_std", "num_seeds")}
            for r in head
        ],
        "verdict": verdict,
        "plots": plots,
    }
