"""benchmarks/grouped_units.py on a tiny width: a row per (estimator, G), the ratios positive,
the layers read per step the same for every G (the forward estimator: every layer once per
sweep) or fewer (backprop's reverse starts on the resident last unit)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))


def test_grouped_units_rows(tmp_path):
    import grouped_units

    rows = grouped_units.main(["--widths", "16", "--groups", "1", "8", "--rounds", "1",
                               "--json", str(tmp_path / "g.json")])
    got = {(r["estimator"], r["layers_per_unit"]): r for r in rows}
    assert set(got) == {(e, g) for e in ("backprop", "forward_weights") for g in (1, 8)}
    assert all(r["ratio"] > 0 and r["memory_ms"] > 0 for r in rows)
    depth = 8
    assert got[("forward_weights", 1)]["layers_read"] == got[("forward_weights", 8)][
        "layers_read"] == 2 * depth
    assert got[("backprop", 1)]["layers_read"] == 2 * depth - 1
    assert got[("backprop", 8)]["layers_read"] == depth  # the one unit stays resident
    assert "| 16 | forward weights | 8 |" in grouped_units.markdown(rows)
