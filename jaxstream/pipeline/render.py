"""Drawing schedule tables: a text grid (stages as rows, ticks as columns) and a PNG chart.

Example:
  >>> from jaxstream.pipeline import gpipe_forward, render_text
  >>> print(render_text(gpipe_forward(2, 2)))
  forward  M=2 N=2 T=3
  s0 | F0 F1  .
  s1 |  . F0 F1
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxstream.pipeline.table import OP_NAMES, Schedule

_COLORS = {"-": "#ffffff", "F": "#9ecae1", "B": "#fdae6b", "W": "#a1d99b", "BW": "#fd8d3c",
           "FBW": "#bcbddc"}


def _cell(s: Schedule, t: int, st: int) -> str:
    k = int(s.kind[t, st])
    if k == 0:
        return "."
    return f"{OP_NAMES[k]}{s.micro[t, st]}" + ("'" if s.stale[t, st] else "")


def render_text(s: Schedule) -> str:
    """A text grid; a trailing ' marks an op on the previous step's micro-batch (stale)."""
    cells = [[_cell(s, t, st) for t in range(s.num_ticks)] for st in range(s.num_stages)]
    width = max((len(c) for row in cells for c in row), default=1)
    head = f"{s.name}  M={s.num_stages} N={s.micro_batches} T={s.num_ticks}"
    lines = [head] + [f"s{st} | " + " ".join(c.rjust(width) for c in row)
                      for st, row in enumerate(cells)]
    return "\n".join(lines)


def render_png(s: Schedule, path: str | Path | None = None, ax=None, title: str | None = None):
    """Draws the table as a Gantt-like chart; saves a PNG when `path` is given.

    Returns:
      The matplotlib Axes drawn on.
    """
    import matplotlib

    if ax is None and path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    own = ax is None
    if own:
        _, ax = plt.subplots(figsize=(max(4.0, 0.35 * s.num_ticks + 1), 0.45 * s.num_stages + 1))
    for t in range(s.num_ticks):
        for st in range(s.num_stages):
            name = OP_NAMES[int(s.kind[t, st])]
            if name == "-":
                continue
            ax.add_patch(Rectangle((t, st), 1, 1, facecolor=_COLORS[name], edgecolor="k", lw=0.4,
                                   hatch="//" if s.stale[t, st] else None))
            if s.num_ticks <= 48:
                ax.text(t + 0.5, st + 0.5, f"{s.micro[t, st]}", ha="center", va="center",
                        fontsize=6)
    ax.set_xlim(0, s.num_ticks)
    ax.set_ylim(s.num_stages, 0)
    ax.set_yticks(np.arange(s.num_stages) + 0.5, [f"s{i}" for i in range(s.num_stages)])
    ax.set_xlabel("tick")
    ax.set_title(title or f"{s.name}  (M={s.num_stages}, N={s.micro_batches}, "
                 f"T={s.num_ticks})", fontsize=9)
    used = sorted({OP_NAMES[int(k)] for k in np.unique(s.kind)} - {"-"}, key=OP_NAMES.index)
    handles = [Patch(facecolor=_COLORS[n], edgecolor="k", label=n) for n in used]
    if s.is_stale:
        handles.append(Patch(facecolor="w", edgecolor="k", hatch="//", label="previous step"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    if own and path is not None:
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=120)
        plt.close(ax.figure)
    return ax
