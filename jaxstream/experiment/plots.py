"""PNG plots of a train run (matplotlib, Agg backend): loss, test accuracy vs steps and vs
training time, and the cosine of each estimate to the exact gradient."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jaxstream.experiment.summary import arm_records


def _series(records: Sequence[dict], x: str, y: str) -> tuple[list, list]:
    pts = [(r[x], r[y]) for r in records if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_plots(records: Sequence[dict], arms: Sequence[str], out_dir: Path,
                target: float | None = None) -> list[Path]:
    """Write ``loss.png``, ``test_accuracy.png`` and (if logged) ``cosine.png``; return paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    per_arm = {a: arm_records(records, a) for a in arms}

    fig, ax = plt.subplots(figsize=(6, 4))
    for a, rs in per_arm.items():
        ax.plot(*_series(rs, "step", "loss"), label=a, lw=1)
    ax.set(xlabel="step", ylabel="train loss (batch)", yscale="log", title="training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=110)
    plt.close(fig)
    written.append(out_dir / "loss.png")

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for a, rs in per_arm.items():
        ax1.plot(*_series(rs, "step", "test_accuracy"), label=a, marker=".")
        ax2.plot(*_series(rs, "train_time", "test_accuracy"), label=a, marker=".")
    for ax in (ax1, ax2):
        if target is not None:
            ax.axhline(target, color="gray", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    ax1.set(xlabel="step", ylabel="test accuracy", title="test accuracy vs steps")
    ax2.set(xlabel="training time (s, excl. evaluation)", title="test accuracy vs wall time")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "test_accuracy.png", dpi=110)
    plt.close(fig)
    written.append(out_dir / "test_accuracy.png")

    if any(r.get("cosine") is not None for r in records):
        fig, ax = plt.subplots(figsize=(6, 4))
        for a, rs in per_arm.items():
            xs, ys = _series(rs, "step", "cosine")
            if xs:
                ax.plot(xs, ys, label=a, marker=".")
        ax.set(xlabel="step", ylabel="cosine(estimate, exact gradient)", title="estimate quality")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "cosine.png", dpi=110)
        plt.close(fig)
        written.append(out_dir / "cosine.png")
    return written
