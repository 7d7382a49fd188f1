"""Lanes: a sweep's (rate, seed) lane is the ``kind: train`` run with that rate and seed, on
the local engine (all lanes in one program) and on the engines that run lanes one by one; the
optimizer is the config's, schedule, warm-up and clipping included."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from jaxstream.experiment.registry import load_experiment
from jaxstream.experiment.rundir import MetricsLog
from jaxstream.experiment.runner import run_experiment
from jaxstream_lab.forward_table import run_table

MODEL = {"type": "mlp", "width": 8, "depth": 2}
# SGD with Nesterov momentum, a warm-up, a cosine decay and clipping: a lane must build all of
# it at its own rate (scaling one optimizer's update by the rate would be wrong for warm-up
# from 0 with clipping only by accident).
OPTIMIZER = {"name": "sgd", "options": {"momentum": 0.9, "nesterov": True}, "clip_norm": 0.5,
             "warmup_steps": 2, "schedule": "cosine"}
ESTIMATOR = {"type": "forward", "perturb": "activations", "num_tangents": 2}


def _table(arms: list[dict], seeds: int = 2, **dataset) -> dict:
    return {"kind": "forward_table", "seed": 0, "seeds": seeds, "extend_sweeps": 0,
            "baselines": False, "cosine_keys": 2, "timing_steps": 1, "optimizer": OPTIMIZER,
            "datasets": [{"name": "d", "data": {"type": "digits"}, "model": MODEL, "steps": 6,
                          "batch_size": 16, "eval_every": 3, "train_eval_size": 32, **dataset}],
            "arms": arms}


def _train_final(tmp_path, seed: int, lr: float, estimator: dict, engine: dict | None = None,
                 optimizer: dict = OPTIMIZER):
    """The final test loss and accuracy of the train run of one arm at ``seed`` and ``lr``
    (the data split of seed 0, as the table loads it)."""
    cfg = {"kind": "train", "seed": seed, "steps": 6, "batch_size": 16, "eval_every": 3,
           "diag_every": 0, "plots": False, "progress": False, "model": MODEL,
           "data": {"type": "digits", "split_seed": 0}, "optimizer": optimizer,
           "arms": [{"name": "a", "estimator": estimator, "lr": lr}]}
    if engine is not None:
        cfg["engine"] = engine
    path = tmp_path / f"train-{seed}-{lr}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir, _ = run_experiment(path, out=tmp_path / f"t-{seed}-{lr}")
    last = [r for r in MetricsLog(run_dir / "metrics.jsonl").read() if "test_loss" in r][-1]
    assert last["step"] == 6
    return last["test_loss"], 1.0 - last["test_accuracy"]


def test_a_table_lane_is_the_train_run_of_its_rate_and_seed(tmp_path):
    """Every (rate, seed) lane of a forward-table row, trained together in one program, ends
    where ``kind: train`` with that seed and rate ends: same params, batches, tangent keys
    and optimizer (from the table's config, not a fixed Adam)."""
    lrs = [0.05, 0.2]
    _, cfg = load_experiment(_table([{"name": "FG-A", "estimator": ESTIMATOR, "lrs": lrs}]))
    (row,) = run_table(cfg)
    assert row["engine"] == "local" and row["optimizer"] == "sgd" and row["lrs"] == lrs
    for i, lr in enumerate(lrs):
        for j, seed in enumerate((0, 1)):
            loss, err = _train_final(tmp_path, seed, lr, ESTIMATOR)
            np.testing.assert_allclose(row["test_loss_by_lr_seed"][i][j], loss, rtol=1e-5)
            np.testing.assert_allclose(row["test_error_by_lr_seed"][i][j], err, atol=1e-6)
    # the lanes differ: by seed (other batches, params, keys) and by rate
    losses = np.asarray(row["test_loss_by_lr_seed"])
    assert len({float(x) for x in losses.ravel()}) == 4


@pytest.mark.parametrize("engine", [
    {"type": "pipeline", "stages": 2, "micro_batches": 2},
    {"type": "stream"},
    {"type": "dataparallel", "devices": 2},
], ids=["pipeline", "stream", "dataparallel"])
def test_a_table_arm_runs_on_another_engine_as_its_train_run_does(tmp_path, engine):
    """An arm whose ``engine`` is the pipeline, the streamed or the data-parallel engine runs
    its lanes one by one through that engine's step: each lane ends where ``kind: train`` on that engine ends, and
    (backprop) where the in-memory row ends; the row says which engine ran it, has no compiled
    step's memory figure, and its estimate is exact."""
    bp = {"type": "backprop"}
    table = _table([{"name": "BP", "estimator": bp, "lrs": [0.1]},
                    {"name": "BP-e", "estimator": bp, "lrs": [0.1], "engine": engine}], seeds=1)
    table["optimizer"] = {k: v for k, v in OPTIMIZER.items() if k != "clip_norm"}  # see below
    _, cfg = load_experiment(table)
    local, other = run_table(cfg)
    assert other["engine"] == engine["type"] and other["peak_temp_bytes"] is None
    assert other["cosine_mean"] == pytest.approx(1.0, abs=1e-5) and other["step_ms"] > 0
    np.testing.assert_allclose(other["test_loss_by_lr_seed"], local["test_loss_by_lr_seed"],
                               rtol=1e-4)
    loss, _ = _train_final(tmp_path, 0, 0.1, bp, engine, table["optimizer"])
    np.testing.assert_allclose(other["test_loss_by_lr_seed"][0][0], loss, rtol=1e-5)


def test_a_streamed_engine_refuses_a_global_norm_clip():
    """The streamed engines update a layer on the host as its gradient completes: a clip by
    the global norm cannot be applied there, so it is refused by name (it once clipped each
    layer by its own norm, silently another optimizer)."""
    for engine in ("stream", "composed"):
        with pytest.raises(ValueError, match=rf"optimizer\.clip_norm: the {engine} engine "
                                             "updates each layer on the host"):
            load_experiment({"kind": "train", "engine": {"type": engine},
                             "optimizer": {"clip_norm": 1.0}})
        with pytest.raises(ValueError, match=r"optimizer\.clip_norm: the"):
            load_experiment(_table([{"name": "BP", "engine": {"type": engine}}]))


def test_table_engine_sections_are_checked_before_compute():
    """What the table cannot honour on an arm's engine is refused by name when it loads."""
    bad = [
        ({"type": "stream", "store": "/tmp/x"},
         r"arms\.0\.engine\.store: the table keeps each lane's layer store in a scratch"),
        ({"type": "pipeline", "stages": 3}, r"arms\.0\.engine\.stages: 3 must divide model\.depth"),
        ({"type": "pipeline", "stages": 2, "micro_batches": 3},
         r"arms\.0\.engine\.micro_batches: 3 must divide datasets\.0\.batch_size=16"),
    ]
    for engine, match in bad:
        with pytest.raises(ValueError, match=match):
            load_experiment(_table([{"name": "BP", "engine": engine}]))
    with pytest.raises(ValueError, match=r"arms\.0\.optimizer\.warmup_steps: the warm-up must "
                                         r"end within datasets\.0\.steps = 6, got 9"):
        load_experiment(_table([{"name": "BP", "optimizer": {"warmup_steps": 9}}]))


def test_a_swept_lane_with_a_schedule_is_the_train_run(tmp_path):
    """``kind: lr_sweep`` takes the whole optimizer section (here warm-up, cosine decay and
    clipping): its lane at a rate ends where ``kind: train`` at that rate ends; 7 steps with an
    evaluation every 3 evaluate at 3, 6 and 7, as ``kind: train`` does."""
    sweep = {"kind": "lr_sweep", "seed": 1, "steps": 7, "batch_size": 16, "eval_every": 3,
             "progress": False, "model": MODEL, "optimizer": OPTIMIZER, "lrs": [0.05, 0.2],
             "arms": [{"name": "a", "estimator": ESTIMATOR}]}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    run_dir, _ = run_experiment(path, out=tmp_path / "s")
    lanes = [r for r in MetricsLog(run_dir / "metrics.jsonl").read() if r["lr"] == 0.2]
    assert [r["step"] for r in lanes] == [3, 6, 7]
    lane = lanes[-1:]
    train = {"kind": "train", "seed": 1, "steps": 7, "batch_size": 16, "eval_every": 3,
             "diag_every": 0, "plots": False, "progress": False, "model": MODEL,
             "optimizer": OPTIMIZER, "arms": [{"name": "a", "estimator": ESTIMATOR, "lr": 0.2}]}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(train))
    t_dir, _ = run_experiment(path, out=tmp_path / "t")
    (ref,) = [r for r in MetricsLog(t_dir / "metrics.jsonl").read()
              if r["step"] == 7 and "test_loss" in r]
    np.testing.assert_allclose(lane[0]["test_loss"], ref["test_loss"], rtol=1e-5)
    np.testing.assert_allclose(lane[0]["loss"], ref["loss"], rtol=1e-5)
