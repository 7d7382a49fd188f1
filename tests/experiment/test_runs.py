"""End-to-end runs: the CLI writes a run directory; same config + seed -> same metrics; a run
interrupted and resumed from its checkpoints ends with the metrics of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.cli import main as cli_main
from jaxstream.experiment.checkpoints import ArmCheckpointer
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.rundir import MetricsLog, strip_time_fields
from jaxstream.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
# quickstart, tiny: a one-block MLP of width 8, 8 steps, evaluation every 2, diagnostics (cosine
# to the exact gradient of the batch) every 3, checkpoints every 4 (and at the last step).
TINY = ["steps=8", "eval_every=2", "diag_every=3", "checkpoint_every=4", "model.width=8",
        "model.depth=1", "batch_size=16"]
# The command line does not depend on the estimators: its run keeps two of quickstart's arms
# (the third, the hybrid, is run in process by the resume test below).
TWO_ARMS = ("arms=[{name: backprop, estimator: {type: backprop}, lr: 0.01}, {name: forward, "
            "estimator: {type: forward, perturb: activations, num_tangents: 4}, lr: 0.003}]")


def _metrics(run_dir: Path) -> list[dict]:
    return [strip_time_fields(r) for r in MetricsLog(run_dir / "metrics.jsonl").read()]


def test_cli_run_writes_a_run_directory(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    args = ["run", str(QUICKSTART), *TINY, TWO_ARMS, "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "jaxstream", *args], capture_output=True,
                          text=True, check=False, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"run directory: {out}" in proc.stdout
    assert "backprop" in proc.stdout and "forward" in proc.stdout  # comparison table
    for name in ("config.yaml", "env.json", "metrics.jsonl", "summary.json", "loss.png",
                 "test_accuracy.png", "cosine.png"):
        assert (out / name).is_file(), name
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"backprop", "forward"}
    env_json = json.loads((out / "env.json").read_text())
    assert env_json["versions"]["jax"] and env_json["backend"] == "cpu"
    assert env_json["overrides"] == [*TINY, TWO_ARMS]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and set(summary["arms"]) == {"backprop", "forward"}
    recs = MetricsLog(out / "metrics.jsonl").read()
    assert [r["arm"] for r in recs] == ["backprop"] * 9 + ["forward"] * 9
    bp = [r for r in recs if r["arm"] == "backprop"]
    assert [r["step"] for r in bp] == list(range(9))
    assert bp[3]["cosine"] == pytest.approx(1.0, abs=1e-5)  # backprop vs itself
    assert {"loss", "step_time", "train_time", "test_accuracy"} <= set(bp[8])

    # The error paths, in process (the run above is the real subprocess).
    monkeypatch.chdir(tmp_path)
    # Same output dir again without --resume: refused before anything is touched.
    before = {p: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert cli_main(args) == 2
    assert "--out" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert cli_main(["run", str(QUICKSTART), "model.widht=8"]) == 2
    assert "model.widht: unknown key" in capsys.readouterr().err


def test_same_config_same_metrics_and_resume_equality(tmp_path):
    cfg = [*TINY, "plots=false"]  # quickstart's three arms: backprop, forward, hybrid
    a, summary = run_experiment(QUICKSTART, cfg, out=tmp_path / "a")
    b, _ = run_experiment(QUICKSTART, cfg, out=tmp_path / "b")
    ma, mb = _metrics(a), _metrics(b)
    assert len(ma) == 3 * 9 and ma == mb
    assert summary["finished"] and set(summary["arms"]) == {"backprop", "forward", "hybrid"}

    # Interrupt after 5 steps, then lose the last checkpoint of one arm (as if the process died
    # between checkpoints): the resumed run must recompute steps 5.. for that arm.
    c, partial = run_experiment(QUICKSTART, [*cfg, "max_steps=5"], out=tmp_path / "c")
    assert not partial["finished"]
    assert max(r["step"] for r in _metrics(c)) == 5
    assert (c / "checkpoints" / "forward" / "4").is_dir()  # what the resumed arm restarts from
    shutil.rmtree(c / "checkpoints" / "forward" / "5")
    c2, resumed = run_experiment(QUICKSTART, cfg, out=tmp_path / "c", resume=True)
    assert c2 == tmp_path / "c" and resumed["finished"]
    assert _metrics(c) == ma

    with pytest.raises(ConfigError, match=r"--resume: the config differs .* in steps"):
        run_experiment(QUICKSTART, [*cfg, "steps=9"], out=tmp_path / "c", resume=True)


def test_restored_checkpoint_is_placed_like_the_state(tmp_path):
    """A fresh run's state is uncommitted; restored, it must be too, or the jitted step sees a
    new input sharding and recompiles when a run is resumed in the same process."""
    state = {"w": jnp.arange(6.0).reshape(2, 3), "count": jnp.zeros((), jnp.int32)}
    ckpt = ArmCheckpointer(tmp_path / "ckpt")
    ckpt.save(4, state, {"train_time": 1.5})
    step, restored, meta = ckpt.restore_latest(state)
    assert step == 4 and meta == {"train_time": 1.5, "step": 4}
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype and not got.committed
    committed = jax.device_put(state, jax.devices()[0])  # a placed state stays placed
    assert all(a.committed for a in jax.tree.leaves(ckpt.restore(4, committed)[0]))
    ckpt.close()


def test_damaged_metrics_line_keeps_every_valid_record(tmp_path):
    """One damaged line in the middle: every valid record after it is kept, a warning names the
    line, and a rewrite (as --resume does) keeps the damaged file beside it. The unfinished last
    line of a killed run is dropped quietly."""
    path = tmp_path / "metrics.jsonl"
    recs = [{"arm": "a", "step": s, "loss": 1.0 / (s + 1)} for s in range(6)]
    lines = [json.dumps(r) for r in recs]
    lines.insert(3, '{"arm": "a", "st')  # damaged line 4
    path.write_text("\n".join(lines) + '\n{"arm": "a", "step": 6')  # + an unfinished last line
    log = MetricsLog(path)
    with pytest.warns(UserWarning, match=r"line\(s\) \[4\] are damaged .* 6 valid records"):
        got = log.read()
    assert got == recs and log.damaged == [4]
    log.rewrite(got)
    assert MetricsLog(path).read() == recs
    assert '{"arm": "a", "st' in (tmp_path / "metrics.jsonl.damaged").read_text()
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"arm": "a"')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a crash's unfinished last line is not damage
        assert MetricsLog(path).read() == recs
