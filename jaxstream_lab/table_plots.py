"""The forward table's plots: test error against training cost in forward passes, and the
memory / time frontier (one colour and marker per arm in every panel)."""

from __future__ import annotations

import math

from jaxstream_lab.table_rows import _is_loss, _m, is_baseline, report_roles


def plot_arms(payload: dict) -> tuple[str, ...]:
    """The arms the cost plot draws: every run's ``report.plot``
    (:func:`jaxstream_lab.table_rows.report_roles`)."""
    return tuple(dict.fromkeys(a for r in report_roles(payload).values() for a in r.plot))


def equivalents_plot(rows: list[dict], path: str, arms: tuple[str, ...] = ()) -> bool:
    """Test error (log scale; test loss for data sets judged by loss) against training cost
    in forward passes (steps × the step's matmul FLOPs over one forward pass's), mean over
    seeds at the picked rate, one line per arm of ``arms`` (every arm where the rows have
    none of them); baselines as grey lines. Rows without a counted cost are left out (said
    in the legend title). False where no row has one (nothing written)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = [r for r in rows if is_baseline(r)]
    rows = [r for r in rows if not is_baseline(r)]
    if any(r["arm"] in arms for r in rows):
        rows = [r for r in rows if r["arm"] in arms]
    counted = [r for r in rows if r.get("forward_equivalents_per_step")]
    if not counted:
        return False
    styles = arm_styles(list(dict.fromkeys(r["arm"] for r in rows)))
    datasets = list(dict.fromkeys(r["dataset"] for r in counted))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for r in (x for x in counted if x["dataset"] == ds):
            loss = _is_loss(r)
            y = [v if loss else 100 * v for v in
                 (r["curve_test_loss_mean"] if loss else r["curve_test_error_mean"])]
            x = [(i + 1) * r["eval_every"] * r["forward_equivalents_per_step"]
                 for i in range(len(y))]
            ax.plot(x, y, color=styles[r["arm"]]["color"], marker=styles[r["arm"]]["marker"],
                    markevery=max(1, len(x) // 6), ms=4, lw=1.2, label=r["arm"])
        for b in (x for x in base if x["dataset"] == ds):
            ax.axhline(b["test_loss_mean"] if _is_loss(b) else 100 * b["test_error_mean"],
                       color="0.5", lw=0.8, ls=":")
            ax.annotate(b["arm"], (1.0, b["test_loss_mean"] if _is_loss(b)
                                   else 100 * b["test_error_mean"]),
                        xycoords=("axes fraction", "data"), fontsize="x-small", color="0.4",
                        ha="right", va="bottom")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # short spans: crowded
        if not any(_is_loss(r) for r in counted if r["dataset"] == ds):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("training cost (forward-pass equivalents, matmul FLOPs)")
        ax.set_ylabel("test loss (nats / char)" if any(_is_loss(r) for r in counted
                                                        if r["dataset"] == ds)
                      else "test error (%)")
        ax.set_title(ds)
        ax.grid(alpha=0.3)
    left = sorted({r["arm"] for r in rows} - {r["arm"] for r in counted})
    handles, labels = axes[0][0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    for ax in axes[0][1:]:
        seen.update(dict(zip(*reversed(ax.get_legend_handles_labels()))))
    fig.legend(list(seen.values()), list(seen.keys()), loc="center left",
               bbox_to_anchor=(1.0, 0.5), fontsize="small", frameon=False,
               title="arm" + (f" (no cost counted: {', '.join(left)})" if left else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def arm_styles(arms: list[str]) -> dict[str, dict]:
    """One colour and marker per arm, the same in every panel: matplotlib's ten default
    colours for up to ten arms, else tab20's twenty; beyond those, the next marker (o, s, D,
    ^)."""
    import matplotlib

    if len(arms) <= 10:
        colours = [f"C{i}" for i in range(10)]
    else:
        colours = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab20"].colors]
    n = len(colours)
    return {a: {"color": colours[i % n], "marker": "osD^"[(i // n) % 4]}
            for i, a in enumerate(arms)}


def frontier_plot(rows: list[dict], path: str) -> None:
    """Test accuracy (or loss) vs peak temporary memory and vs training time, one point per arm
    and data set. Each arm keeps one colour and marker in every panel, named once in a legend
    beside the panels (nothing is written over the data); log axes label their decades only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    base = [r for r in rows if is_baseline(r)]
    rows = [r for r in rows if not is_baseline(r)]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    styles = arm_styles(arms)
    styles_b = ("--", ":", "-.", (0, (5, 2, 1, 2, 1, 2)))
    lines = {b: styles_b[i % len(styles_b)]
             for i, b in enumerate(dict.fromkeys(r["arm"] for r in base))}
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 3.6 * len(datasets)), squeeze=False)
    for i, ds in enumerate(datasets):
        rs = [r for r in rows if r["dataset"] == ds]
        for j, (xkey, label) in enumerate((("mem", "peak temporary memory (MiB)"),
                                           ("time", "training time (s, steps × step time)"))):
            ax = axes[i, j]
            for r in rs:
                if xkey == "mem" and r.get("peak_temp_bytes") is None:
                    continue  # not one compiled program: no figure to place
                x = (r["peak_temp_bytes"] / 2**20 if xkey == "mem"
                     else r["steps"] * r["step_ms"] / 1e3)
                mean, sd = _m(r)
                y, err = (mean, sd) if _is_loss(r) else (100 * (1 - mean), 100 * sd)
                ax.errorbar(x, y, yerr=err, fmt=styles[r["arm"]]["marker"], capsize=3,
                            color=styles[r["arm"]]["color"], label=r["arm"], alpha=0.85)
            y0, y1 = ax.get_ylim()  # baselines inside the arms' range (the rest: the table)
            for b in (r for r in base if r["dataset"] == ds):
                mean = b["test_loss_mean"] if _is_loss(b) else 100 * (1 - b["test_error_mean"])
                if y0 <= mean <= y1:
                    ax.axhline(mean, color="0.4", lw=1, ls=lines[b["arm"]])
            ax.set_ylim(y0, y1)
            ax.set_xscale("log")
            lo, hi = ax.get_xlim()  # 1-2-5 ticks where they fit, decades on wider axes
            wide = math.log10(hi / lo) > 2
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel(label)
            ax.set_ylabel("test loss (nats / char, lower is better)" if any(map(_is_loss, rs))
                          else "test accuracy (%)")
            ax.set_title(ds)
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], ls="", marker=styles[a]["marker"], color=styles[a]["color"],
                          label=a) for a in arms]
    handles += [plt.Line2D([], [], color="0.4", lw=1, ls=ls, label=f"{b} (baseline)")
                for b, ls in lines.items()]
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small",
               title="arm", frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
