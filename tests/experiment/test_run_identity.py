"""A checkpoint or a layer store is trained on only by the run (and optimizer) it belongs to:
a local checkpoint copied in from another run is refused on ``--resume`` naming both runs, a
store handed over with ``engine.continue_store`` is refused when it holds another optimizer's
state, naming both optimizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxstream.cli import main as cli_main
from jaxstream.experiment.checkpoints import ArmCheckpointer, CheckpointError, identity
from jaxstream.experiment.runner import run_experiment
from jaxstream.stream.errors import StoreError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
STREAM = ROOT / "experiments" / "stream_mlp.yaml"
TINY = ["steps=4", "eval_every=2", "diag_every=0", "checkpoint_every=2", "model.width=8",
        "model.depth=1", "batch_size=16", "plots=false", "progress=false"]


def _arm(lr: float) -> str:
    return f"arms=[{{name: backprop, estimator: {{type: backprop}}, lr: {lr}}}]"


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "env.json").read_text())["run_id"]


def test_a_checkpoint_copied_from_another_run_is_refused(tmp_path, capsys):
    a, _ = run_experiment(QUICKSTART, [*TINY, _arm(0.01), "max_steps=2"], out=tmp_path / "a")
    b, _ = run_experiment(QUICKSTART, [*TINY, _arm(0.3), "max_steps=2"], out=tmp_path / "b")
    shutil.rmtree(b / "checkpoints")
    shutil.copytree(a / "checkpoints", b / "checkpoints")
    metrics = (b / "metrics.jsonl").read_bytes()
    code = cli_main(["run", str(QUICKSTART), *TINY, _arm(0.3), "--out", str(b), "--resume"])
    assert code == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, errors
    assert f"written by run {_run_id(a)}, arm backprop, optimizer adam, not by this run " \
           f"{_run_id(b)}" in errors[0]
    assert "run_id differ" in errors[0] and "Put this run's own checkpoints back" in errors[0]
    assert (b / "metrics.jsonl").read_bytes() == metrics  # nothing trained, nothing lost
    # The run that wrote them resumes them.
    _, summary = run_experiment(QUICKSTART, [*TINY, _arm(0.01)], out=a, resume=True)
    assert summary["finished"]


def test_checkpoint_identity_names_the_optimizer_and_accepts_old_checkpoints(tmp_path):
    state = {"w": jnp.arange(6.0), "count": jnp.int32(3)}
    mine = identity("run-1", "bp", {"name": "adam", "options": {}})
    ArmCheckpointer(tmp_path / "c", identity=identity(
        "run-1", "bp", {"name": "sgd", "options": {"momentum": 0.9}})).save(1, state)
    with pytest.raises(CheckpointError, match=r"optimizer sgd momentum=0\.9, not by this run "
                                              r"run-1, arm bp, optimizer adam.*optimizer differ"):
        ArmCheckpointer(tmp_path / "c", identity=mine).restore(1, state)
    # A checkpoint written before identities were recorded: restored with a warning.
    ArmCheckpointer(tmp_path / "old").save(1, state)
    with pytest.warns(UserWarning, match="records no run identity"):
        _, got, _ = ArmCheckpointer(tmp_path / "old", identity=mine).restore_latest(state)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool((x == y).all()), got, state))


STORE_TINY = ["steps=4", "eval_every=2", "diag_every=0", "checkpoint_every=1", "model.width=8",
              "model.depth=2", "batch_size=16", "plots=false", "progress=false",
              "arms=[{name: bp, estimator: {type: backprop}, lr: 0.003}]"]


def test_continue_store_refuses_another_optimizers_state(tmp_path):
    store = tmp_path / "stores" / "{arm}"
    run_experiment(STREAM, [*STORE_TINY, f"engine.store={store}", "max_steps=2"],
                   out=tmp_path / "a")
    with pytest.raises(StoreError, match=r"holds the state of optimizer adam, this run's "
                                         r"optimizer is adabelief; set the optimizer section"):
        run_experiment(STREAM, [*STORE_TINY, f"engine.store={store}", "optimizer.name=adabelief",
                                "engine.continue_store=true"], out=tmp_path / "b")
    # sgd keeps no state: the store's leaves differ too, and still both optimizers are named
    with pytest.raises(StoreError, match=r"holds the state of optimizer adam, this run's "
                                         r"optimizer is sgd"):
        run_experiment(STREAM, [*STORE_TINY, f"engine.store={store}", "optimizer.name=sgd",
                                "engine.continue_store=true"], out=tmp_path / "b2")
    _, summary = run_experiment(STREAM, [*STORE_TINY, f"engine.store={store}",
                                         "engine.continue_store=true"], out=tmp_path / "c")
    assert summary["finished"]  # the same optimizer hands over as before
