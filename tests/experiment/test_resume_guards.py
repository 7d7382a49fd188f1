"""What ``--resume`` and ``--rollback`` refuse, before any compute and losing nothing: both at
once; ``--rollback`` on a run that never diverged (it would rewrite the lr behind the run's
results); a resume whose metrics.jsonl lost checkpointed steps (the summary would be wrong).
And ``--resume`` without ``--out`` picks the latest ``runs/<name>*``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxstream.cli import main as cli_main
from jaxstream.experiment.runner import resolve_run_dir, run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
TINY = ["steps=4", "eval_every=2", "diag_every=0", "checkpoint_every=2", "model.width=8",
        "model.depth=1", "batch_size=16", "plots=false", "progress=false"]
ARM = "arms=[{name: bp, estimator: {type: backprop}, lr: %s}]"
KEPT = ("config.yaml", "env.json", "metrics.jsonl", "summary.json")


def _files(run: Path) -> dict[str, bytes | None]:
    return {n: (run / n).read_bytes() if (run / n).exists() else None for n in KEPT}


def _refused(args: list[str], capsys) -> str:
    """Runs the CLI, expects exit 2 with one line, returns it."""
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_resume_without_out_picks_the_highest_numbered_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("quickstart", "quickstart_2", "quickstart_10", "quickstart2", "quickstart_x",
                 "quickstart_11"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        if name != "quickstart_11":  # no config.yaml: not a run
            (tmp_path / "runs" / name / "config.yaml").write_text("kind: train\n")
    assert resolve_run_dir(QUICKSTART, None, resume=True) == Path("runs/quickstart_10")


def test_resume_and_rollback_together_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["run", str(QUICKSTART), "--resume", "--rollback", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_rollback_of_a_run_that_never_diverged_is_refused_and_changes_nothing(tmp_path,
                                                                                capsys):
    run = tmp_path / "run"
    assert cli_main(["run", str(QUICKSTART), *TINY, ARM % 0.01, "--out", str(run)]) == 0
    capsys.readouterr()
    before = _files(run)
    err = _refused(["run", str(QUICKSTART), *TINY, ARM % 1e-3, "--out", str(run),
                    "--rollback"], capsys)
    assert "--rollback: no arm of" in err and "(arms: bp)" in err and "--resume" in err
    assert _files(run) == before


def _stopped_run(tmp_path: Path, capsys) -> Path:
    """A run stopped at step 2 of 4 (checkpoints at step 2)."""
    run = tmp_path / "run"
    assert cli_main(["run", str(QUICKSTART), *TINY, ARM % 0.01, "max_steps=2",
                     "--out", str(run)]) == 0
    capsys.readouterr()
    return run


def test_resume_refuses_a_missing_or_cut_metrics_log_and_keeps_a_crash_tail(tmp_path, capsys):
    run = _stopped_run(tmp_path, capsys)
    metrics = run / "metrics.jsonl"
    text = metrics.read_text()
    args = ["run", str(QUICKSTART), *TINY, ARM % 0.01, "--out", str(run), "--resume"]
    metrics.write_text(text[:-5])  # the last record (step 2, checkpointed) cut
    before = _files(run)
    err = _refused(args, capsys)
    assert f"{metrics} ends in an incomplete line" in err and "step 2" in err
    assert _files(run) == before
    lines = text.splitlines()
    lines[1] = "#" + lines[1][1:]  # a damaged line, not the last one
    metrics.write_text("\n".join(lines) + "\n")
    before = _files(run)
    err = _refused(args, capsys)
    assert f"{metrics} has damaged line(s) [2]" in err, err
    assert _files(run) == before
    metrics.unlink()
    before = _files(run)
    err = _refused(args, capsys)
    assert f"{metrics} is missing" in err and "from step 0" in err
    assert _files(run) == before
    # A line cut past the last checkpoint (a run killed mid-write) loses nothing: resumed.
    metrics.write_text(text + '{"arm": "bp", "st')
    _, summary = run_experiment(QUICKSTART, [*TINY, ARM % 0.01], out=run, resume=True)
    assert summary["finished"] and summary["arms"]["bp"]["lost_steps"] == []
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]


def test_resume_without_env_json_names_it_and_writes_nothing(tmp_path, capsys):
    """env.json holds the run's identity: with results but no env.json a --resume is refused
    naming the file (not the checkpoints it would then disown), and no new env.json is left."""
    from jaxstream.cli import main

    run = tmp_path / "run"
    args = ["run", str(QUICKSTART), *TINY, "max_steps=2", "--out", str(run)]
    assert main(args) == 0
    (run / "env.json").unlink()
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "env.json is missing; it holds the run's identity" in err, err
    assert not (run / "env.json").exists()
