"""``jaxstream compare`` refuses with one line (exit 2): a run of a kind it does not compare, an
unreadable summary.json, a ``--plot`` extension matplotlib cannot write; it prints the plot
file it actually wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxstream.cli import main
from tests.experiment.test_cli import fake_run

ACCS = [0.5, 0.96, 0.97]


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("kind", ["lr_sweep", "finetune"])
def test_a_run_of_another_kind_is_refused(tmp_path: Path, capsys, monkeypatch, kind: str):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "t", {"bp": ACCS})
    other = fake_run(tmp_path / "o", {"bp": ACCS})
    (other / "config.yaml").write_text(f"kind: {kind}\n")
    (other / "summary.json").write_text(json.dumps({"arms": {"bp": {"picked_lr": 0.1}}}))
    err = _error(capsys, ["compare", "t", "o", "--plot", "c.png"])
    assert f"o: a '{kind}' run; compare compares 'train' runs only" in err
    assert not (tmp_path / "c.png").exists()


def test_an_unreadable_summary_is_refused(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (fake_run(tmp_path / "bad", {"bp": ACCS}) / "summary.json").write_text("{bad\n")
    assert "bad/summary.json: not readable JSON" in _error(capsys, ["compare", "bad"])


def test_a_plot_extension_matplotlib_cannot_write_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "r", {"bp": ACCS})
    err = _error(capsys, ["compare", "r", "--plot", "c.txt"])
    assert "--plot c.txt: cannot write a '.txt' file" in err and ".png" in err and ".pdf" in err
    assert not (tmp_path / "c.txt").exists()


def test_the_printed_plot_path_is_the_file_written(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "r", {"bp": ACCS})
    assert main(["compare", "r", "--plot", "r"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("plot: r.png")
    assert (tmp_path / "r.png").is_file()
