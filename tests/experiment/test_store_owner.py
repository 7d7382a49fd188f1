"""A layer store knows the run that wrote it last: a ``--resume`` refuses a store another run
has trained on (or one copied in), and a run that continues another's store on purpose
(``engine.continue_store``) records the hand-over in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxstream.experiment.runner import run_experiment
from jaxstream.stream.errors import StoreError
from jaxstream.stream.store import LayerStore

ROOT = Path(__file__).resolve().parents[2]
STREAM = ROOT / "experiments" / "stream_mlp.yaml"
TINY = ["steps=4", "eval_every=2", "diag_every=0", "checkpoint_every=1", "model.width=8",
        "model.depth=2", "batch_size=16", "plots=false", "progress=false",
        "arms=[{name: bp, estimator: {type: backprop}, lr: 0.003}]"]


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "env.json").read_text())["run_id"]


def test_resume_refuses_a_store_another_run_has_trained(tmp_path):
    store = tmp_path / "stores" / "{arm}"
    a, _ = run_experiment(STREAM, [*TINY, f"engine.store={store}", "max_steps=2"],
                          out=tmp_path / "a")
    b, summary = run_experiment(STREAM, [*TINY, f"engine.store={store}", "arms.0.lr=0.1",
                                         "engine.continue_store=true"], out=tmp_path / "b")
    assert summary["finished"] and _run_id(a) != _run_id(b)
    opened = LayerStore.open(str(tmp_path / "stores" / "bp"))
    assert opened.step == 4 and opened.extra["run"] == _run_id(b)
    assert opened.extra["handovers"] == [{"from_run": _run_id(a), "to_run": _run_id(b),
                                          "step": 2}]
    opened.close()
    config = (a / "config.yaml").read_bytes()
    with pytest.raises(StoreError, match=rf"last written by another run \({_run_id(b)}\), not "
                                         rf"this one \({_run_id(a)}\).*continue_store=true"):
        run_experiment(STREAM, [*TINY, f"engine.store={store}"], out=a, resume=True)
    assert (a / "config.yaml").read_bytes() == config
    # The run that wrote the store last resumes it (a resume keeps the run's identity).
    _, again = run_experiment(STREAM, [*TINY, f"engine.store={store}", "arms.0.lr=0.1",
                                       "engine.continue_store=true"], out=b, resume=True)
    assert again["finished"] and _run_id(b) == opened.extra["run"]


def test_a_rolled_back_store_trains_on_in_a_new_run(tmp_path):
    """docs/streaming.md's way back from a bad step: roll the store back one commit, then a
    new run continues it (engine.continue_store=true) from that step, recording the hand-over;
    the old run's --resume refuses it (its checkpoint is ahead of the store)."""
    store = tmp_path / "stores" / "{arm}"
    a, _ = run_experiment(STREAM, [*TINY, f"engine.store={store}", "max_steps=2"],
                          out=tmp_path / "a")
    opened = LayerStore.open(str(tmp_path / "stores" / "bp"))
    assert opened.rollback() == 1
    opened.close()
    with pytest.raises(StoreError, match="at step 1, behind the checkpoint at step 2"):
        run_experiment(STREAM, [*TINY, f"engine.store={store}"], out=a, resume=True)
    b, summary = run_experiment(STREAM, [*TINY, f"engine.store={store}",
                                         "engine.continue_store=true"], out=tmp_path / "b")
    assert summary["finished"]
    def steps(run):
        return [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()
                if "loss" in json.loads(ln)]

    assert steps(a)[0] == 1 and steps(b)[0] == 2  # a record counts the steps done: b began at 1
    after = LayerStore.open(str(tmp_path / "stores" / "bp"))
    assert after.step == 4 and after.extra["handovers"] == [
        {"from_run": _run_id(a), "to_run": _run_id(b), "step": 1}]


def test_a_handed_over_run_logs_where_it_began_not_lost_steps(tmp_path):
    """A run that continues another run's store starts at the store's step: its first record
    is that step, evaluated and marked ``handed_over``; no step before it is logged (they are
    the other run's), not as lost either, and a resume of it keeps it so."""
    store = tmp_path / "stores" / "{arm}"
    run_experiment(STREAM, [*TINY, f"engine.store={store}", "max_steps=2"], out=tmp_path / "a")
    b = tmp_path / "b"
    args = [*TINY, f"engine.store={store}", "engine.continue_store=true"]
    _, summary = run_experiment(STREAM, [*args, "max_steps=3"], out=b)
    _, summary = run_experiment(STREAM, args, out=b, resume=True)
    assert summary["finished"]
    records = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r.get("arm") == "bp"]
    assert steps == [2, 3, 4], steps
    first = records[[r.get("arm") for r in records].index("bp")]
    assert first["handed_over"] and "test_accuracy" in first and "loss" not in first
    assert not any(r.get("lost") for r in records)
    assert summary["arms"]["bp"].get("lost_steps", []) == []


def test_a_hand_over_that_would_train_nothing_is_refused(tmp_path, capsys):
    from jaxstream.cli import main

    store = tmp_path / "stores" / "{arm}"
    run_experiment(STREAM, [*TINY, f"engine.store={store}"], out=tmp_path / "a")  # at step 4
    args = ["run", str(STREAM), *TINY, f"engine.store={store}", "engine.continue_store=true"]
    assert main([*args, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "steps: 4 is not past step 4, where the layer store this run continues" in err, err
    assert not (tmp_path / "b").exists()
    assert main([*args, "steps=6", "max_steps=3", "--out", str(tmp_path / "c")]) == 2
    assert "max_steps: 3 is not past step 4" in capsys.readouterr().err


def test_resume_refuses_a_store_a_copy_of_the_run_trained(tmp_path):
    """A run directory copied and resumed trains the store the original names (engine.store
    outside the run): the original's --resume then finds the store past its checkpoint with
    steps its log never saw. Refused naming the other directory, nothing logged as lost."""
    import shutil

    store = tmp_path / "stores" / "{arm}"
    a = tmp_path / "a"
    run_experiment(STREAM, [*TINY, f"engine.store={store}", "max_steps=2"], out=a)
    shutil.copytree(a, tmp_path / "copy")
    run_experiment(STREAM, [*TINY, f"engine.store={store}"], out=tmp_path / "copy", resume=True)
    metrics = (a / "metrics.jsonl").read_bytes()
    with pytest.raises(StoreError, match=r"past this run's checkpoint at step 2, trained from "
                                         r"another directory with this run's identity \(.*copy"):
        run_experiment(STREAM, [*TINY, f"engine.store={store}"], out=a, resume=True)
    assert (a / "metrics.jsonl").read_bytes() == metrics


def test_a_damaged_store_manifest_on_resume_says_how_to_go_on(tmp_path, capsys):
    from jaxstream.cli import main

    store = tmp_path / "stores" / "{arm}"
    args = ["run", str(STREAM), *TINY, f"engine.store={store}", "--out", str(tmp_path / "a")]
    assert main([*args, "max_steps=2"]) == 0
    manifest = tmp_path / "stores" / "bp" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "manifest.json" in err and "to go on, restore the store" in err, err


def test_a_damaged_chunk_found_by_a_step_says_how_to_go_on(tmp_path, capsys):
    """A chunk of the last commit damaged on disk: the resumed step that reads it names the
    file and the ways on; the second way (roll back one commit, train on in a new run) runs."""
    from jaxstream.cli import main

    store = tmp_path / "stores" / "{arm}"
    args = ["run", str(STREAM), *TINY, f"engine.store={store}", "--out", str(tmp_path / "a")]
    assert main([*args, "max_steps=2"]) == 0
    where = tmp_path / "stores" / "bp"
    slot = json.loads((where / "manifest.json").read_text())["slots"]["blocks"][1]
    chunk = next((where / "params" / "blocks" / "0" / "c" / "1" / str(slot)).rglob("*"))
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0xFF  # one flipped bit pattern: the crc32c no longer matches
    chunk.write_bytes(bytes(data))
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "nothing of this step was committed" in err, err
    assert "rollback()" in err and "continue_store=true" in err, err
    opened = LayerStore.open(str(where))
    assert opened.rollback() == 1
    opened.close()
    b = ["run", str(STREAM), *TINY, f"engine.store={store}", "engine.continue_store=true",
         "--out", str(tmp_path / "b")]
    assert main(b) == 0
    assert LayerStore.open(str(where)).step == 4
