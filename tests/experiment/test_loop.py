"""The training loop: which steps each hook sees, with which state, and early stopping."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxstream.experiment.loop import Resume, TrainLoop, resumed_records


class Count(NamedTuple):
    n: int


def _step(state: Count, batch: float, key: int) -> tuple[Count, dict]:
    """State counts steps; the loss is the batch, a lane array comes back as a NumPy array."""
    return Count(state.n + 1), {"loss": batch, "lanes": np.array([key, key + 1.0])}


def _loop(**kw) -> TrainLoop:
    return TrainLoop(_step, batch_at=lambda s: 10.0 * s, key_at=lambda s: s, tags={"arm": "a"},
                     **kw)


def test_hooks_run_every_n_at_given_steps_and_at_end_with_the_right_state():
    seen: dict[str, list] = {"every3": [], "at": [], "end": [], "before": [], "all": []}
    loop = _loop()
    loop.add_hook(lambda i: seen["before"].append((i.step, i.state.n, i.key)), every=2,
                  before=True)
    loop.add_hook(lambda i: seen["every3"].append((i.step, i.state.n)), every=3)
    loop.add_hook(lambda i: seen["at"].append(i.step), every=0, at=(5,))
    loop.add_hook(lambda i: seen["end"].append((i.step, i.last)), every=0, at_end=True)
    loop.add_hook(lambda i: seen["all"].append(dict(i.record)))
    out = loop.run(Count(2), start=2, stop=7, train_time=1.0)
    assert out.state == Count(7) and out.step == 7 and not out.stopped
    assert seen["before"] == [(4, 3, 3), (6, 5, 5)]      # state before the step, key of s=step-1
    assert seen["every3"] == [(3, 3), (6, 6)]            # state after the step
    assert seen["at"] == [5] and seen["end"] == [(7, True)]
    recs = seen["all"]
    assert [r["step"] for r in recs] == [3, 4, 5, 6, 7]
    assert list(recs[0])[:2] == ["arm", "step"] and recs[0]["loss"] == 20.0
    np.testing.assert_array_equal(recs[0]["lanes"], [2.0, 3.0])
    times = [r["step_time"] for r in recs]
    assert math.isclose(out.train_time, 1.0 + sum(times))
    assert math.isclose(recs[-1]["train_time"], out.train_time)


def test_stop_if_ends_after_that_step_and_marks_it_last():
    ends = []
    loop = _loop(stop_if=lambda r: r["loss"] >= 30.0)
    loop.add_hook(lambda i: ends.append((i.step, i.last)), every=0, at_end=True)
    out = loop.run(Count(0), start=0, stop=10)
    assert out.stopped and out.step == 4 and out.state == Count(4) and ends == [(4, True)]


def test_empty_range_runs_nothing():
    calls = []
    loop = _loop()
    loop.add_hook(calls.append, at_end=True)
    out = loop.run(Count(5), start=5, stop=5)
    assert out == (Count(5), 5, False, 0.0) and calls == []


def test_untimed_loop_leaves_metrics_as_returned():
    recs = []
    loop = TrainLoop(_step, batch_at=lambda s: 1.0, key_at=lambda s: s, timed=False)
    loop.add_hook(lambda i: recs.append(dict(i.record)))
    out = loop.run(Count(0), start=0, stop=2)
    assert out.train_time == 0.0 and [sorted(r) for r in recs] == [["lanes", "loss", "step"]] * 2


class _Checkpointer:
    """restore_latest as ArmCheckpointer's: (step, state, meta), or (None, like, {})."""

    def __init__(self, step):
        self.step = step

    def restore_latest(self, like):
        if self.step is None:
            return None, like, {}
        return self.step, Count(self.step), {"train_time": 2.5, "diverged": False}


def test_start_hooks_resume_then_reconcile_in_order():
    resume = Resume(_Checkpointer(4))
    loop = _loop()
    loop.add_start_hook(resume)
    loop.add_start_hook(lambda state, start: (Count(state.n + 1), start + 1))  # a store ahead
    state, start = loop.begin(Count(0))
    assert (state, start) == (Count(5), 5) and resume.train_time == 2.5 and not resume.diverged
    out = loop.run(state, start=start, stop=7, train_time=resume.train_time)
    assert out.state == Count(7) and out.train_time > 2.5


def test_resume_without_checkpoint_starts_at_zero():
    resume = Resume(_Checkpointer(None))
    loop = _loop()
    loop.add_start_hook(resume)
    assert loop.begin(Count(0)) == (Count(0), 0) and resume.train_time == 0.0


def test_resumed_records_keep_steps_up_to_start_and_mark_lost_ones():
    kept = [{"arm": "a", "step": s, "loss": float(s)} for s in (0, 1, 3, 5)]
    recs = resumed_records(kept, 4, {"arm": "a"})
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    assert recs[2] == {"arm": "a", "step": 2, "lost": True} and "lost" not in recs[3]
    assert resumed_records(kept, 0, {"arm": "a"}) == []


def test_the_closing_line_says_a_max_steps_stop_and_shows_the_tables_figures(capsys,
                                                                             monkeypatch):
    from jaxstream.experiment import progress

    monkeypatch.setattr(progress, "ENABLED", True)
    rec = {"step": 4, "loss": 0.7, "test_loss": 0.5, "test_accuracy": 0.9}
    progress.arm_done("fwd", rec, stopped_at=4, steps=10)
    line = capsys.readouterr().err.strip()
    assert line == ("fwd: stopped at step 4 of 10 (max_steps; continue with --resume), "
                    "step 4, test loss 0.500, test acc 0.900")
    progress.arm_done("fwd", rec)
    assert capsys.readouterr().err.strip().startswith("fwd: done, step 4, test loss 0.500")
