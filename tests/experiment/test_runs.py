"""End-to-end runs: the CLI writes a run directory; same config + seed -> same metrics; a run
interrupted and resumed from its checkpoints ends with the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.rundir import MetricsLog, strip_time_fields
from jaxstream.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]

TINY = {
    "kind": "train",
    "seed": 3,
    "steps": 8,
    "batch_size": 16,
    "eval_every": 2,
    "diag_every": 3,
    "checkpoint_every": 2,
    "model": {"type": "mlp", "width": 8, "depth": 2},
    "plots": False,
    "progress": False,
    "arms": [
        {"name": "bp", "estimator": {"type": "backprop"}, "lr": 0.01},
        {"name": "fg", "estimator": {"type": "forward", "perturb": "activations",
                                     "num_tangents": 2}, "lr": 0.01},
        {"name": "hy", "estimator": {"type": "hybrid", "micro_batches": 4, "num_exact": 1}},
    ],
}


def _write(tmp_path: Path, data: dict) -> Path:
    import yaml

    p = tmp_path / "tiny.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _metrics(run_dir: Path) -> list[dict]:
    return [strip_time_fields(r) for r in MetricsLog(run_dir / "metrics.jsonl").read()]


def test_cli_run_writes_a_run_directory(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [sys.executable, "-m", "jaxstream", "run", str(ROOT / "experiments" / "quickstart.yaml"),
           "steps=4", "eval_every=2", "diag_every=2", "checkpoint_every=2", "model.width=8",
           "batch_size=16", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "run directory:" in proc.stdout and "backprop" in proc.stdout  # comparison table
    for name in ("config.yaml", "env.json", "metrics.jsonl", "summary.json", "loss.png",
                 "test_accuracy.png", "cosine.png"):
        assert (out / name).is_file(), name
    env_json = json.loads((out / "env.json").read_text())
    assert env_json["versions"]["jax"] and env_json["backend"] == "cpu"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and set(summary["arms"]) == {"backprop", "forward", "hybrid"}
    recs = MetricsLog(out / "metrics.jsonl").read()
    bp = [r for r in recs if r["arm"] == "backprop"]
    assert [r["step"] for r in bp] == [0, 1, 2, 3, 4]
    assert bp[2]["cosine"] == pytest.approx(1.0, abs=1e-5)  # backprop vs itself
    assert {"loss", "step_time", "train_time", "test_accuracy"} <= set(bp[4])
    # Same output dir again without --resume: refused before anything is touched.
    again = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=tmp_path,
                           timeout=300)
    assert again.returncode == 2 and "--out" in again.stderr
    bad = subprocess.run(cmd[:5] + ["model.widht=8"], capture_output=True, text=True, check=False, env=env,
                         cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "model.widht: unknown key" in bad.stderr


def test_same_config_same_metrics_and_resume_equality(tmp_path):
    cfg = _write(tmp_path, TINY)
    a, summary = run_experiment(cfg, out=tmp_path / "a")
    b, _ = run_experiment(cfg, out=tmp_path / "b")
    ma, mb = _metrics(a), _metrics(b)
    assert len(ma) == 3 * 9 and ma == mb
    assert summary["finished"]

    # Interrupt after 5 steps, then lose the last checkpoint of one arm (as if the process died
    # between checkpoints): the resumed run must recompute steps 5.. for that arm.
    c, partial = run_experiment(cfg, ["max_steps=5"], out=tmp_path / "c")
    assert not partial["finished"]
    assert max(r["step"] for r in _metrics(c)) == 5
    shutil.rmtree(c / "checkpoints" / "fg" / "5")
    c2, resumed = run_experiment(cfg, out=tmp_path / "c", resume=True)
    assert c2 == tmp_path / "c" and resumed["finished"]
    assert _metrics(c) == ma

    with pytest.raises(ConfigError, match=r"--resume: the config differs .* in steps"):
        run_experiment(cfg, ["steps=9"], out=tmp_path / "c", resume=True)
