"""The north-star table's bytes column: the median bytes read / written per streamed step."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import north_star as ns


def _row(steps: list[dict]) -> dict:
    return {"width": 16, "estimator": "backprop", "cache": "warm",
            **ns.summarise([1.0] * len(steps), steps)}


def test_bytes_column_is_the_median_per_step():
    steps = [{"wall_s": 2.0, "blocking": 1, "bytes_read": r, "bytes_written": w}
             for r, w in ((3 << 20, 2048), (5 << 20, 4096), (4 << 20, 3072))]
    row = _row(steps)
    assert (row["bytes_read"], row["bytes_written"]) == (4 << 20, 3072)
    header, _, line = ns.table({"r": row}).splitlines()
    cells = [c.strip() for c in line.split("|")]
    assert cells[header.split("|").index(" read / written per step ")] == "4.0 MiB / 3 KiB"


def test_results_from_before_bytes_render_a_dash():
    row = _row([{"wall_s": 2.0, "blocking": 1}])
    assert "bytes_read" not in row
    assert "| 1 | – |" in ns.table({"r": row})
