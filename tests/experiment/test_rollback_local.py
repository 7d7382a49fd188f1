"""``--rollback`` on a local (in-memory) run: it continues from the last checkpoint saved
before the run diverged, so a diverged run taken back and trained on at a sound learning rate
writes the metrics of a run that never diverged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxstream.experiment.rundir import strip_time_fields
from jaxstream.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
TINY = ["steps=6", "eval_every=2", "diag_every=0", "checkpoint_every=2", "model.width=8",
        "model.depth=1", "batch_size=16", "plots=false", "progress=false",
        "optimizer.name=sgd"]


def _arm(lr: float) -> str:
    return f"arms=[{{name: backprop, estimator: {{type: backprop}}, lr: {lr}}}]"


def _records(run: Path) -> list[dict]:
    return [strip_time_fields(json.loads(ln))
            for ln in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_rollback_continues_a_diverged_local_run_from_its_last_sane_checkpoint(tmp_path):
    """Diverged at lr 3e38, then ``--rollback`` at lr 0.1: the metrics of a run that never
    diverged, plus one record naming the step from which the new lr applies."""
    clean, _ = run_experiment(QUICKSTART, [*TINY, _arm(0.1)], out=tmp_path / "clean")
    run = tmp_path / "run"
    _, summary = run_experiment(QUICKSTART, [*TINY, _arm(3e38)], out=run)
    assert summary["arms"]["backprop"]["diverged"]
    assert _records(run)[-1]["loss"] in (None, 1e308)  # JSON's non-finite loss
    _, summary = run_experiment(QUICKSTART, [*TINY, _arm(3e38)], out=run, resume=True)
    assert summary["arms"]["backprop"]["diverged"]  # --resume does not continue it
    _, summary = run_experiment(QUICKSTART, [*TINY, _arm(0.1)], out=run, rollback=True)
    assert summary["finished"] and not summary["arms"]["backprop"]["diverged"]
    marks = [r for r in _records(run) if r.get("rollback")]
    assert len(marks) == 1 and marks[0]["lr"] == 0.1
    assert [r for r in _records(run) if not r.get("rollback")] == _records(clean)


def test_rollback_refuses_a_new_lr_for_an_arm_that_did_not_diverge(tmp_path):
    """Only a diverged arm is trained again; another arm's results stand at the lr they were
    trained at, so a --rollback that changes its lr is refused (nothing rewritten)."""
    from jaxstream.experiment.config import ConfigError

    two = ("arms=[{name: bad, estimator: {type: backprop}, lr: %g}, "
           "{name: good, estimator: {type: backprop}, lr: 0.1}]")
    run = tmp_path / "run"
    _, summary = run_experiment(QUICKSTART, [*TINY, two % 3e38], out=run)
    assert summary["arms"]["bad"]["diverged"] and not summary["arms"]["good"]["diverged"]
    config = (run / "config.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"--rollback: the config differs .* in arms\.1\.lr; "
                                          r"only .*the lr of the arms that diverged \(bad\)"):
        run_experiment(QUICKSTART, [*TINY, two.replace("lr: 0.1", "lr: 0.2") % 0.1], out=run,
                       rollback=True)
    assert (run / "config.yaml").read_bytes() == config
    _, summary = run_experiment(QUICKSTART, [*TINY, two % 0.1], out=run, rollback=True)
    assert summary["finished"] and not summary["arms"]["bad"]["diverged"]
