"""The other run kinds refuse, before anything runs, what would lose results or crash late:
a duplicate lr_sweep arm (one arm's results were dropped: they are kept by name), a rate listed
twice, a forward_table lrs_by_dataset key that names no data set (the arm ran at its plain lrs
silently), an empty arms or datasets list (a matplotlib traceback after the table ran), and a
finetune with no arms (an IndexError after pretraining)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.registry import load_experiment

ROOT = Path(__file__).resolve().parents[2] / "experiments"


@pytest.mark.parametrize("config, overrides, says", [
    ("lr_sweep_digits.yaml",
     ["arms=[{name: a, estimator: {type: backprop}}, {name: a, estimator: {type: forward}}]"],
     r"arms\.1\.name: 'a' is used twice"),
    ("lr_sweep_digits.yaml", ["lrs=[0.01, 1e-2]"], r"lrs: each rate at most once"),
    ("forward_table_quick.yaml",
     [("arms=[{name: BP, estimator: {type: backprop}, lrs: [0.01], "
       "lrs_by_dataset: {digitz: [0.5]}}]"), "report={}"],
     r"arms\.0\.lrs_by_dataset\.digitz: not a data set of the table"),
    ("forward_table_quick.yaml", ["arms=[]", "report={}"], r"^arms: list at least one"),
    ("forward_table_quick.yaml", ["datasets=[]"], r"^datasets: list at least one"),
    ("finetune_stream.yaml", ["arms=[]"], r"^arms: list at least one arm"),
])
def test_refused_before_anything_runs(config, overrides, says):
    with pytest.raises((ConfigError, ValueError), match=says):
        load_experiment(ROOT / config, overrides)


def test_a_kind_that_cannot_resume_does_not_point_at_resume(tmp_path):
    """--out holding files: a train run is told to --resume; an lr_sweep, which cannot be
    resumed, is told to choose another directory."""
    from jaxstream.experiment.runner import resolve_run_dir

    (tmp_path / "x").write_text("")
    with pytest.raises(ConfigError, match="pass --resume to continue that run"):
        resolve_run_dir("c.yaml", tmp_path, resume=False)
    with pytest.raises(ConfigError, match="cannot be resumed: choose another directory"):
        resolve_run_dir("c.yaml", tmp_path, resume=False, resumable=False)


def test_the_tables_report_names_the_command_and_config_the_runner_recorded(tmp_path):
    """results.md said `jaxstream run` (config `?`): it now reads the run's env.json."""
    import json

    from jaxstream_lab.invocation import invocation

    assert invocation(tmp_path, "jaxstream run") == (None, "jaxstream run")
    (tmp_path / "env.json").write_text(json.dumps(
        {"config": "ft.yaml", "overrides": ["seeds=2", "arms.0.lrs=[0.01]"]}))
    assert invocation(tmp_path, "jaxstream run") == (
        "ft.yaml", "jaxstream run ft.yaml seeds=2 arms.0.lrs=[0.01]")


@pytest.mark.parametrize("below", ["", "/{arm}"])
def test_a_store_path_that_is_or_lies_under_a_file_names_engine_store(tmp_path, capsys, below):
    """It was 'StoreWriteError: cannot open the writer lock ...: File exists' (or 'Not a
    directory'), naming no field."""
    from jaxstream.cli import main

    (tmp_path / "afile").write_text("hi")
    store = f"{tmp_path / 'afile'}{below}"
    assert main(["run", str(ROOT / "quickstart.yaml"), "steps=2", "plots=false",
                 f"engine={{type: stream, store: '{store}'}}",
                 "arms=[{name: bp, estimator: {type: backprop}, lr: 0.01}]",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: engine.store: ") and "a file" in err, err
    assert not (tmp_path / "run").exists()
