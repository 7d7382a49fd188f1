"""Defects of runs and their directories, each refused in one line or handled with a warning:
``compare`` of a run without a (usable) summary, repeated lines of metrics.jsonl on
``--resume``, an optimizer option value its factory refuses, a damaged env.json, an empty data
set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxstream.cli import main
from jaxstream.experiment import train
from jaxstream.experiment.data_configs import DataConfig
from jaxstream.experiment.rundir import strip_time_fields
from tests.experiment.test_cli import fake_run

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
TINY = ["steps=2", "eval_every=1", "diag_every=0", "checkpoint_every=1", "model.width=8",
        "model.depth=2", "batch_size=16", "plots=false", "progress=false",
        "arms=[{name: bp, estimator: {type: backprop}, lr: 0.01}]"]


def _error(capsys, argv: list[str]) -> str:
    """The CLI exits 2 with one ``error:`` line, which is returned."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _records(path: Path) -> list[dict]:
    return [strip_time_fields(json.loads(line)) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("summary", [None, '{"x": 1}', '{"arms": ["bp"]}'])
def test_compare_refuses_a_run_without_a_summary_of_arms(tmp_path, capsys, monkeypatch,
                                                         summary):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "ok", {"bp": [0.5, 0.96]})
    run = fake_run(tmp_path / "r", {"bp": [0.5, 0.96]})
    if summary is None:  # a killed run
        (run / "summary.json").unlink()
    else:
        (run / "summary.json").write_text(summary)
    err = _error(capsys, ["compare", "ok", "r", "--plot", "c.png"])
    if summary is None:
        assert "r: no summary.json: the run did not finish" in err and "--resume" in err
    else:
        assert 'r/summary.json: has no "arms"' in err
    assert not (tmp_path / "c.png").exists()


def test_resume_drops_repeated_metrics_lines_with_a_warning(tmp_path, capsys):
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(["run", str(QUICKSTART), *TINY, "--out", str(full)]) == 0
    assert main(["run", str(QUICKSTART), *TINY, "max_steps=1", "--out", str(cut)]) == 0
    log = cut / "metrics.jsonl"
    text = log.read_text()
    log.write_text(text + text)  # every line twice
    with pytest.warns(UserWarning, match=r"line\(s\) 3-4 repeat earlier records \(arm bp "
                                         r"step 0, arm bp step 1\)"):
        assert main(["run", str(QUICKSTART), *TINY, "--out", str(cut), "--resume"]) == 0
    assert _records(log) == _records(full / "metrics.jsonl")
    assert (cut / "metrics.jsonl.damaged").read_text() == text + text  # nothing lost


def test_a_bad_optimizer_option_value_is_one_line_before_any_write(tmp_path, capsys):
    out = tmp_path / "o"
    err = _error(capsys, ["run", str(QUICKSTART), *TINY, "optimizer.options.mu_dtype=float99",
                          "--out", str(out)])
    assert err.startswith("error: optimizer.options.mu_dtype: ") and "float99" in err
    assert not out.exists()
    assert main(["run", str(QUICKSTART), *TINY, "max_steps=1", "--out", str(out)]) == 0


def test_a_value_refused_after_the_run_directory_was_made_leaves_none(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise TypeError("data type 'float99' not understood")

    monkeypatch.setattr(train, "model_for", refuse)
    out = tmp_path / "o"
    with pytest.raises(TypeError, match="float99"):
        main(["run", str(QUICKSTART), *TINY, "--out", str(out)])
    assert not out.exists()


def test_a_damaged_env_json_is_one_line_on_resume(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["run", str(QUICKSTART), *TINY, "max_steps=1", "--out", str(out)]) == 0
    (out / "env.json").write_text("xx\n")
    config = (out / "config.yaml").read_bytes()
    capsys.readouterr()
    err = _error(capsys, ["run", str(QUICKSTART), *TINY, "--out", str(out), "--resume"])
    assert f"{out / 'env.json'}: not readable JSON" in err
    assert (out / "env.json").read_text() == "xx\n"
    assert (out / "config.yaml").read_bytes() == config


def test_an_empty_data_set_says_it_has_no_training_examples():
    class Empty(DataConfig):
        def train_size(self, seed: int) -> int:
            return 0

    with pytest.raises(ValueError, match=r"^data: the data set has no training examples") as e:
        Empty().check_batch(1, 0)
    assert "1..0" not in str(e.value)
