"""PNG plots of train, lr_sweep and compared runs (matplotlib, Agg backend).

Lines stay distinguishable when arms coincide (each arm has its own marker and line style, and
a note names the arms whose curves are identical); axes are labelled in words; the cosine is a
smoothed line over faint raw points; reference lines carry a label; step axes have integer
ticks; wall-time axes start after ``WARMUP_STEPS`` steps of each arm, so the first arm is not
charged with the process's warm-up (caches, allocator, first dispatches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxstream.experiment.summary import arm_records

#: Steps of each arm left out of wall-time axes (time is counted from the end of this step).
WARMUP_STEPS = 5
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style(i: int, n: int = 10) -> dict[str, Any]:
    """Line style of series ``i`` with ``n`` points: a marker and a dash pattern of its own;
    about 10 markers per line, shifted per series so that coinciding lines show every marker."""
    every = max(1, n // 10)
    return {"marker": MARKERS[i % len(MARKERS)], "ls": LINESTYLES[(i // 2) % len(LINESTYLES)],
            "color": f"C{i % 10}", "markersize": 4, "lw": 1.2, "markevery": ((i * max(1, every // 3)) % every, every)}


def series(records: Sequence[dict], x: str, y: str) -> tuple[list, list]:
    """Points of ``y`` against ``x`` where both are logged."""
    pts = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def time_series(records: Sequence[dict], y: str, skip: int = WARMUP_STEPS) -> tuple[list, list]:
    """``y`` against training seconds counted from the end of step ``skip`` (warm-up excluded)."""
    t0 = next((r["train_time"] for r in records
               if r.get("step") == skip and r.get("train_time") is not None), None)
    if t0 is None:
        return [], []
    pts = [(r["train_time"] - t0, r[y]) for r in records if r.get("step", 0) >= skip
           and r.get("train_time") is not None and r.get(y) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def tick_series(records: Sequence[dict], y: str) -> tuple[list, list]:
    """``y`` against the pipeline ticks spent so far (the steps' ``ticks`` summed)."""
    total, xs, ys = 0.0, [], []
    for r in sorted(records, key=lambda r: r.get("step", 0)):
        total += r.get("ticks") or 0.0
        if r.get(y) is not None:
            xs.append(total)
            ys.append(r[y])
    return xs, ys


def smooth(ys: Sequence[float], window: int = 5) -> list[float]:
    """Centred moving average (shorter windows at the ends)."""
    h = window // 2
    return [sum(ys[max(0, i - h):i + h + 1]) / len(ys[max(0, i - h):i + h + 1])
            for i in range(len(ys))]


def coinciding(curves: dict[str, tuple[list, list]]) -> list[list[str]]:
    """Groups (2 or more) of names whose curves are identical point for point."""
    groups: dict[tuple, list[str]] = {}
    for name, (xs, ys) in curves.items():
        if ys:
            groups.setdefault((tuple(xs), tuple(round(v, 9) for v in ys)), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def note_coinciding(ax: Any, curves: dict[str, tuple[list, list]]) -> None:
    """Write "lines coincide: a = b" in the corner of ``ax`` where that happens."""
    groups = coinciding(curves)
    if groups:
        text = "lines coincide: " + "; ".join(" = ".join(g) for g in groups)
        ax.text(0.01, 0.01, text, transform=ax.transAxes, fontsize=7, va="bottom",
                color="dimgray", wrap=True)


def _integer_x(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plotted_target(cfg: Any, labels: Any) -> float | None:
    """The test-accuracy target a train run's plots draw, or None for no line.

    ``target_accuracy`` defaults to a classifier's target (one label per example). Next-token
    accuracy (``labels`` with a position axis: a character model) has no such target, so there
    a line is drawn only where the config sets a target of its own (other than the default).

    Example:
      >>> write_plots(records, arms, run_dir, plotted_target(cfg, data.train["y"]))
    """
    target = getattr(cfg, "target_accuracy", None)
    if target is None or getattr(labels, "ndim", 1) <= 1:
        return target
    default = next((f.default for f in dataclasses.fields(cfg) if f.name == "target_accuracy"),
                   None)
    return None if target == default else target


def _target_line(ax: Any, target: float | None) -> None:
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=0.8, label=f"target {target:.0%}")


def _panel(ax: Any, per_arm: dict[str, list[dict]], y: str, *, by_time: bool) -> None:
    curves = {}
    for i, (a, rs) in enumerate(per_arm.items()):
        xs, ys = time_series(rs, y) if by_time else series(rs, "step", y)
        curves[a] = (xs, ys)
        if xs:
            ax.plot(xs, ys, label=a, **style(i, len(xs)))
    note_coinciding(ax, curves)
    ax.grid(alpha=0.3)
    if by_time:
        ax.set_xlabel(f"training time (s, from step {WARMUP_STEPS}; evaluation excluded)")
    else:
        ax.set_xlabel("step")
        _integer_x(ax)


def _legend(ax: Any, source: Any = None) -> None:
    """``source``'s legend (default ``ax``'s) beside ``ax``, right of the data: it covers no
    curve whatever their shape."""
    handles, labels = (source or ax).get_legend_handles_labels()
    if labels:
        ax.legend(handles, labels, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  frameon=False)


def _save(fig: Any, path: Path, layout: bool = True) -> Path:
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def write_plots(records: Sequence[dict], arms: Sequence[str], out_dir: Path,
                target: float | None = None) -> list[Path]:
    """Write ``loss.png``, ``test_accuracy.png``, (if logged) ``test_loss.png`` against ticks
    and time, and ``cosine.png``; return paths."""
    plt = _plt()
    out_dir = Path(out_dir)
    per_arm = {a: arm_records(records, a) for a in arms}
    written = []

    fig, ax = plt.subplots(figsize=(6.5, 4))
    _panel(ax, per_arm, "loss", by_time=False)
    ax.set(ylabel="training loss (batch, before the update)", yscale="log", title="training loss")
    _legend(ax)
    written.append(_save(fig, out_dir / "loss.png"))

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.5, 4), sharey=True)
    _panel(ax1, per_arm, "test_accuracy", by_time=False)
    _panel(ax2, per_arm, "test_accuracy", by_time=True)
    for ax in (ax1, ax2):
        _target_line(ax, target)
    ax1.set(ylabel="test accuracy", title="test accuracy against steps")
    ax2.set(title="test accuracy against training time")
    _legend(ax2, ax1)
    written.append(_save(fig, out_dir / "test_accuracy.png"))

    if any(r.get("ticks") for r in records):  # pipelined engines: cost in ticks and time
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.5, 4), sharey=True)
        curves = {}
        for i, (a, rs) in enumerate(per_arm.items()):
            curves[a] = tick_series(rs, "test_loss")
            if curves[a][0]:
                ax1.plot(*curves[a], label=a, **style(i, len(curves[a][0])))
        note_coinciding(ax1, curves)
        ax1.grid(alpha=0.3)
        _panel(ax2, per_arm, "test_loss", by_time=True)
        ax1.set(xlabel="pipeline ticks (summed over steps)", ylabel="test loss",
                title="test loss against ticks")
        ax2.set(title="test loss against training time")
        _legend(ax2, ax1)
        written.append(_save(fig, out_dir / "test_loss.png"))

    if any(r.get("cosine") is not None for r in records):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        curves, smoothed = {}, False
        for i, (a, rs) in enumerate(per_arm.items()):
            xs, ys = series(rs, "step", "cosine")
            curves[a] = (xs, ys)
            if not xs:
                continue
            window = 5 if len(ys) >= 20 else 1  # few diagnostics: the points themselves
            smoothed |= window > 1
            label = f"{a} (moving average of {window})" if window > 1 else a
            line, = ax.plot(xs, smooth(ys, window), label=label, **style(i, len(xs)))
            ax.scatter(xs, ys, s=8, alpha=0.25, color=line.get_color())
        note_coinciding(ax, curves)
        ax.set(xlabel="step", ylabel="cosine(estimate, exact gradient of the batch)",
               title="estimate quality" + (" (faint points: single steps)" if smoothed else ""))
        _integer_x(ax)
        ax.grid(alpha=0.3)
        _legend(ax)
        written.append(_save(fig, out_dir / "cosine.png"))
    if any("cosine_embed" in r for r in records):
        written.append(layer_cosine_plot(per_arm, out_dir / "cosine_layers.png"))
    return written


def segment_names(records: Sequence[dict]) -> list[str]:
    """The segments a run's per-layer diagnostics name, in model order (embed, blocks, head)."""
    keys = {k.removeprefix("cosine_") for r in records for k in r if k.startswith("cosine_")}
    blocks = sorted((k for k in keys if k.startswith("block_")), key=lambda k: int(k[6:]))
    return [k for k in ("embed", *blocks, "head") if k in keys]


def layer_cosine_plot(per_arm: dict[str, list[dict]], path: Path) -> Path:
    """One panel per arm: each segment's cosine to the exact gradient against the step (solid,
    coloured from the embed to the head), and for an estimator that follows local losses its
    cosine to the local target (dashed): the local losses' bias, told apart from noise."""
    plt = _plt()
    arms = [a for a, rs in per_arm.items() if any("cosine_embed" in r for r in rs)]
    fig, axes = plt.subplots(1, len(arms), figsize=(5.2 * len(arms), 3.8), squeeze=False,
                             sharey=True)
    cmap = plt.get_cmap("viridis")
    for ax, arm in zip(axes[0], arms):
        rs = per_arm[arm]
        names = segment_names(rs)
        for j, seg in enumerate(names):
            color = cmap(j / max(1, len(names) - 1))
            xs, ys = series(rs, "step", f"cosine_{seg}")
            ax.plot(xs, ys, color=color, lw=1.2, label=seg.replace("_", " "))
            xs, ys = series(rs, "step", f"local_cosine_{seg}")
            if xs:
                ax.plot(xs, ys, color=color, lw=1.0, ls="--")
        ax.set(title=arm, xlabel="step")
        _integer_x(ax)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("cosine per layer (solid: to the gradient,\ndashed: to the local target)")
    axes[0][-1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.0, 0.5),
                       frameon=False)
    return _save(fig, Path(path))


def write_compare_plot(records: Sequence[dict], arms: Sequence[str], path: Path,
                       target: float | None = None) -> Path:
    """One figure of several runs' arms: test accuracy and loss against steps and time."""
    plt = _plt()
    per_arm = {a: arm_records(records, a) for a in arms}
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharey="row")
    for col, by_time in enumerate((False, True)):
        _panel(axes[0][col], per_arm, "test_accuracy", by_time=by_time)
        _target_line(axes[0][col], target)
        _panel(axes[1][col], per_arm, "loss", by_time=by_time)
        axes[1][col].set_yscale("log")
    axes[0][0].set(ylabel="test accuracy", title="against steps")
    axes[0][1].set(title="against training time")
    axes[1][0].set(ylabel="training loss (batch)")
    _legend(axes[0][1], axes[0][0])
    return _save(fig, Path(path))


def write_sweep_plots(summary: dict, records: Sequence[dict], out_dir: Path) -> list[Path]:
    """``lr_sweep.png`` (final accuracy and steps to target against learning rate) and
    ``lr_sweep_curves.png`` (each arm's test accuracy at its picked learning rate)."""
    plt = _plt()
    out_dir = Path(out_dir)
    target = summary.get("target_accuracy")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for i, (name, a) in enumerate(summary["arms"].items()):
        lrs = [float(lr) for lr in a["results"]]
        res = list(a["results"].values())
        ax1.plot(lrs, [r["final_accuracy"] for r in res], label=name, **style(i, 1))
        pts = [(lr, r["steps_to_target"]) for lr, r in zip(lrs, res)
               if r["steps_to_target"] is not None]
        if pts:
            ax2.plot(*zip(*pts), label=name, **style(i, 1))
    _target_line(ax1, target)
    ax1.set(xscale="log", xlabel="learning rate", ylabel="final test accuracy (mean of last evals)",
            title="accuracy against learning rate")
    ax2.set(xscale="log", xlabel="learning rate",
            ylabel=f"steps to {target:.0%} test accuracy" if target else "steps to target",
            title="speed against learning rate (missing: never reached)")
    from matplotlib.ticker import MaxNLocator

    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize="small")
    fig.tight_layout(rect=(0, 0.06 + 0.05 * ((len(labels) - 1) // 6), 1, 1))
    written = [_save(fig, out_dir / "lr_sweep.png", layout=False)]

    fig, ax = plt.subplots(figsize=(7, 4.2))
    curves = {}
    for i, (name, a) in enumerate(summary["arms"].items()):
        rs = sorted((r for r in records if r.get("arm") == name
                     and r.get("lr") == a["picked_lr"]), key=lambda r: r["step"])
        xs, ys = series(rs, "step", "test_accuracy")
        curves[name] = (xs, ys)
        ax.plot(xs, ys, label=f"{name} (lr {a['picked_lr']:.0e})", **style(i, len(xs)))
    note_coinciding(ax, curves)
    _target_line(ax, target)
    ax.set(xlabel="step", ylabel="test accuracy", title="each arm at its picked learning rate")
    _integer_x(ax)
    ax.grid(alpha=0.3)
    _legend(ax)
    written.append(_save(fig, out_dir / "lr_sweep_curves.png"))
    return written
