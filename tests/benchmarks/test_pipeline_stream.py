"""benchmarks/pipeline_stream.py's reading of a run's metrics: ticks summed step by step up to
each evaluation, per-step medians, the loss at a tick budget, and the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pipeline_stream as ps


def _records(arm, ticks, losses, reads=12.0):
    """Metrics as a run writes them: an evaluation at step 0, then steps, some evaluated."""
    out = [{"arm": arm, "step": 0, "test_loss": losses[0], "test_accuracy": 0.1}]
    for s in range(1, 5):
        r = {"arm": arm, "step": s, "ticks": ticks, "layers_read": reads, "step_time": 0.1 * s,
             "stall_time": 0.01, "update_wait_time": 0.02, "write_wait_time": 0.03}
        if s % 2 == 0:
            r.update(test_loss=losses[s // 2], test_accuracy=0.2)
        out.append(r)
    return out


def test_curves_sum_ticks_to_each_evaluation_and_the_table_reads_them():
    res = {"a": ps.curves(_records("bp", 38.0, [5.0, 4.0, 3.0]) +
                          _records("cv", 28.0, [5.0, 4.5, 3.5], reads=20.0))}
    bp, cv = res["a"]["bp"], res["a"]["cv"]
    assert [p[0] for p in bp["points"]] == [0.0, 76.0, 152.0]
    assert [p[0] for p in cv["points"]] == [0.0, 56.0, 112.0]
    assert (bp["ticks_per_step"], cv["layers_read_per_step"]) == (38.0, 20.0)
    assert bp["step_s"] == pytest.approx(0.3)  # the median of steps 2..4 (the first compiles)
    assert ps.at(bp["points"], 112.0) == 4.0 and ps.at(cv["points"], 112.0) == 3.5
    table = ps.table(res)
    assert "test loss at 112 ticks" in table
    assert "| a | bp | 38 | 12 | 4.000 | 3.000 | 152 |" in table
