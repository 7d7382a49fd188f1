"""A table of gradient-quality rows that prints, saves (JSON / CSV) and plots.

One row per (estimator, layer group) with the fields of
:class:`~jaxstream.quality.metrics.SeedStatistics` as floats. The table lives on the host.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxstream.quality.groups import WHOLE, order_groups
from jaxstream.quality.metrics import SeedStatistics

#: Columns printed by default: (row key, header, format).
DEFAULT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("cosine_mean", "cosine", "{:.4f}"),
    ("cosine_std", "+-std", "{:.4f}"),
    ("norm_ratio_mean", "norm ratio", "{:.3g}"),
    ("relative_error_mean", "rel. error", "{:.3g}"),
    ("bias", "bias", "{:.3g}"),
    ("relative_variance", "rel. var", "{:.3g}"),
    ("snr", "SNR", "{:.3g}"),
)


def rows_from_statistics(
    stats: Mapping[str, SeedStatistics], num_seeds: int, **extra: Any
) -> list[dict[str, Any]]:
    """Flatten ``{estimator: SeedStatistics}`` into rows ``{estimator, group, metric: float}``.

    Args:
      stats: statistics per estimator name.
      num_seeds: R, stored in every row.
      **extra: constant columns added to every row (e.g. ``setting="shuffled"``).

    Example:
      >>> rows = rows_from_statistics({"forward": stats}, num_seeds=32, setting="shuffled")
    """
    rows = []
    for name, s in stats.items():
        for group in order_groups(list(s.cosine_mean)):
            row: dict[str, Any] = {"estimator": name, "group": group, **extra}
            for field in SeedStatistics._fields:
                row[field] = float(getattr(s, field)[group])
            row["num_seeds"] = num_seeds
            rows.append(row)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table; ``columns`` are ``(key, header, format)``; str values print as is.

    Example:
      >>> print(format_table(rows, [("estimator", "estimator", "{}"), ("cosine_mean", "cos", "{:.3f}")]))
    """
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append(
            [
                str(row[k]) if isinstance(row.get(k), str) else fmt.format(row[k])
                for k, _, fmt in columns
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class QualityTable:
    """Rows of gradient-quality statistics; ``print`` it, ``save`` it, ``plot`` it.

    Attributes:
      rows: list of dicts ``{estimator, group, cosine_mean, cosine_std, ...}``.

    Example:
      >>> table = compare(estimators, stack, params, batch, seeds=32)
      >>> print(table)                      # whole-model rows
      >>> print(table.format(groups=None))  # every layer group
      >>> table.plot().savefig("cosine.png", bbox_inches="tight")  # the legend is beside the axes
    """

    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows

    @property
    def estimators(self) -> list[str]:
        """Estimator names in insertion order."""
        return list(dict.fromkeys(r["estimator"] for r in self.rows))

    @property
    def groups(self) -> list[str]:
        """Layer group names in model order (``all`` last)."""
        return list(dict.fromkeys(r["group"] for r in self.rows))

    def row(self, estimator: str, group: str = WHOLE) -> dict[str, Any]:
        """The row of one estimator and group."""
        for r in self.rows:
            if r["estimator"] == estimator and r["group"] == group:
                return r
        raise KeyError(f"no row for estimator={estimator!r}, group={group!r}")

    def format(self, groups: Sequence[str] | None = (WHOLE,)) -> str:
        """Plain-text table of the given groups (None: every group)."""
        rows = [r for r in self.rows if groups is None or r["group"] in groups]
        cols = [("estimator", "estimator", "{}"), ("group", "group", "{}"), *DEFAULT_COLUMNS]
        return format_table(rows, cols)

    def __str__(self) -> str:
        return self.format()

    def __repr__(self) -> str:
        return f"QualityTable({len(self.estimators)} estimators, {len(self.groups)} groups)"

    def save(self, path: str | Path) -> Path:
        """Write the rows as JSON (``.json``) or CSV (``.csv``)."""
        return save_rows(self.rows, path)

    def plot(self, metric: str = "cosine_mean", spread: str | None = "cosine_std", ax: Any = None):
        """Per-layer plot of ``metric`` (error bars from ``spread``) for every estimator.

        Returns:
          the matplotlib ``Figure``.
        """
        from jaxstream.quality.plots import plot_per_layer

        return plot_per_layer(self.rows, metric=metric, spread=spread, ax=ax)


def save_rows(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows as JSON (a list of objects) or CSV (header = union of keys), by suffix.

    Example:
      >>> save_rows(table.rows, run_dir / "quality.csv")
    """
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps(list(rows), indent=1))
    elif path.suffix == ".csv":
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
    else:
        raise ValueError(f"path: suffix must be .json or .csv, got {path.name!r}")
    return path
