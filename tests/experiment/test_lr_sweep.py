"""lr_sweep: each vmapped learning-rate lane reproduces a train run with that learning rate."""

from __future__ import annotations

import numpy as np
import yaml

from jaxstream.experiment.lr_sweep import format_sweep, pick_lr
from jaxstream.experiment.rundir import MetricsLog
from jaxstream.experiment.runner import run_experiment

COMMON = {"seed": 1, "steps": 6, "batch_size": 16, "eval_every": 3, "progress": False,
          "model": {"type": "mlp", "width": 8, "depth": 1}}
ESTIMATOR = {"type": "forward", "perturb": "activations", "num_tangents": 2}


def test_sweep_lane_equals_train_run(tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"kind": "lr_sweep", **COMMON, "lrs": [0.01, 0.003],
                                     "arms": [{"name": "fg", "estimator": ESTIMATOR}]}))
    train = tmp_path / "train.yaml"
    train.write_text(yaml.safe_dump({"kind": "train", **COMMON, "diag_every": 0, "plots": False,
                                     "arms": [{"name": "fg", "estimator": ESTIMATOR,
                                               "lr": 0.003}]}))
    s_dir, summary = run_experiment(sweep, out=tmp_path / "s")
    t_dir, _ = run_experiment(train, out=tmp_path / "t")
    lane = [r for r in MetricsLog(s_dir / "metrics.jsonl").read() if r["lr"] == 0.003]
    ref = {r["step"]: r for r in MetricsLog(t_dir / "metrics.jsonl").read()
           if "test_loss" in r and r["step"] > 0}
    assert [r["step"] for r in lane] == sorted(ref) == [3, 6]
    for r in lane:
        for k in ("loss", "test_loss", "test_accuracy"):
            np.testing.assert_allclose(r[k], ref[r["step"]][k], rtol=1e-4, atol=1e-6)
    assert set(summary["arms"]["fg"]["results"]) == {"0.01", "0.003"}
    # final accuracy: the mean over the evaluations there were (2 of final_evals' 4), said so
    assert summary["final_evals"] == 2
    got = summary["arms"]["fg"]["results"]["0.003"]["final_accuracy"]
    np.testing.assert_allclose(got, np.mean([r["test_accuracy"] for r in lane]), rtol=1e-6)
    assert "last 2 evaluations" in format_sweep(summary, (0.01, 0.003))


def test_pick_lr_prefers_fast_and_stable():
    res = {1e-3: {"steps_to_target": 100, "final_accuracy": 0.97},
           1e-2: {"steps_to_target": 50, "final_accuracy": 0.90},   # fast but unstable
           3e-3: {"steps_to_target": 75, "final_accuracy": 0.965}}
    assert pick_lr(res, 0.96) == 3e-3
    none = {1e-3: {"steps_to_target": None, "final_accuracy": 0.8},
            1e-2: {"steps_to_target": None, "final_accuracy": 0.85}}
    assert pick_lr(none, 0.96) == 1e-2
