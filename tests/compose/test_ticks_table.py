"""The equal-ticks table of a pipelined run is read from its metrics, not typed."""

from pathlib import Path

import pytest

from jaxstream.experiment.doctable import ticks_markdown


def _run(records):
    return {"dir": Path("runs/x"), "records": records, "summary": {"arms": {}}, "env": {}}


def test_equal_ticks_picks_each_arms_last_evaluation_within_the_budget():
    recs = []
    for arm, rate in (("slow", 20.0), ("fast", 10.0)):
        for step in range(1, 7):
            r = {"arm": arm, "step": step, "ticks": rate, "loss": 1.0}
            if step % 2 == 0:
                r.update(test_loss=10.0 * step + rate, test_accuracy=step / 10 + rate / 1000)
            recs.append(r)
    rows = ticks_markdown(_run(recs)).splitlines()
    assert "at 60 ticks" in rows[0]  # the smaller total: 6 steps x 10 ticks
    slow = next(r for r in rows if r.startswith("| slow"))
    fast = next(r for r in rows if r.startswith("| fast"))
    # slow: step 2 (40 ticks) is the last evaluation within 60; fast: its last, step 6
    assert slow.split(" | ")[2:4] == ["40.000", "0.220"]
    assert fast.split(" | ")[2:4] == ["70.000", "0.610"]


def test_runs_without_ticks_are_refused():
    with pytest.raises(ValueError, match="must log 'ticks'"):
        ticks_markdown(_run([{"arm": "a", "step": 1, "loss": 1.0}]))
