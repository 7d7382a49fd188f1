"""The run directory is left as found by a refused run, is used by one process at a time, and
the machine's errors (a full disk, a dangling --out) are one line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from jaxstream.cli import main as cli_main
from jaxstream.cli import user_error_line
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.rundir import run_lock
from jaxstream.experiment.runner import run_experiment
from jaxstream.stream.errors import StoreMismatchError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
STREAM = ROOT / "experiments" / "stream_mlp.yaml"
TINY = ["steps=2", "eval_every=1", "diag_every=0", "checkpoint_every=1", "model.width=8",
        "model.depth=2", "batch_size=16", "plots=false", "progress=false"]
ONE_ARM = "arms=[{name: bp, estimator: {type: backprop}, lr: 0.01}]"


def test_a_store_refused_in_the_run_leaves_no_run_directory(tmp_path):
    """A new run told to continue a store of another model is refused by the store when the
    arm starts; the run directory it had made is gone, the store untouched."""
    store = tmp_path / "stores" / "{arm}"
    run_experiment(STREAM, [*TINY, ONE_ARM, f"engine.store={store}"], out=tmp_path / "a")
    manifest = tmp_path / "stores" / "bp" / "manifest.json"
    before = manifest.read_bytes()
    other = [*TINY, ONE_ARM, f"engine.store={store}", "model.width=16",
             "engine.continue_store=true"]
    out = tmp_path / "b"
    with pytest.raises(StoreMismatchError):
        run_experiment(STREAM, other, out=out)
    assert not out.exists()
    out.mkdir()  # an empty directory the user made: kept, and kept empty
    with pytest.raises(StoreMismatchError):
        run_experiment(STREAM, other, out=out)
    assert out.is_dir() and not any(out.iterdir())
    assert manifest.read_bytes() == before


def test_one_process_at_a_time_in_a_run_directory(tmp_path):
    out = tmp_path / "run"
    run_experiment(QUICKSTART, [*TINY, ONE_ARM, "max_steps=1"], out=out)
    config = (out / "config.yaml").read_bytes()
    # another process's lock: flock conflicts across open files
    with run_lock(out), pytest.raises(ConfigError,
                                      match=rf"in use by another process \(pid {os.getpid()}"):
        run_experiment(QUICKSTART, [*TINY, ONE_ARM], out=out, resume=True)
    assert (out / "config.yaml").read_bytes() == config
    _, summary = run_experiment(QUICKSTART, [*TINY, ONE_ARM], out=out, resume=True)
    assert summary["finished"]  # the lock went with its holder


def test_a_dangling_out_link_is_one_line(tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere" / "run")
    assert cli_main(["run", str(QUICKSTART), *TINY, "--out", str(link)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "symbolic link to" in err and "does not exist" in err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EEXIST])
def test_the_machines_errors_are_one_line(code):
    e = OSError(code, os.strerror(code), "/runs/x/metrics.jsonl")
    assert user_error_line(e) == f"{os.strerror(code)}: /runs/x/metrics.jsonl"
    assert user_error_line(RuntimeError("a bug")) is None  # a bug keeps its traceback


@pytest.mark.parametrize("kind", ["dangling link", "file"])
def test_a_foreign_default_runs_is_one_line_naming_it(tmp_path, monkeypatch, capsys, kind):
    """A fresh clone whose ``runs`` is a link to another machine's folder, or a file."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    if kind == "file":
        runs.write_text("not a folder")
    else:
        runs.symlink_to("/nonexistent/elsewhere/runs")
    assert cli_main(["run", str(QUICKSTART), *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs" in err[0] and "--out" in err[0]
    assert ("rm runs" in err[0]) == (kind == "dangling link")
    assert runs.is_symlink() == (kind == "dangling link")  # nothing of the user's was touched


@pytest.mark.parametrize("out", [True, False])
def test_a_run_directory_the_machine_refuses_names_out(tmp_path, monkeypatch, capsys, out):
    """A read-only or vanished parent (here: mkdir refused with EROFS): the line names --out
    (or the default run directory) and the directory, not only the system's message."""
    monkeypatch.chdir(tmp_path)

    def refuse(self, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    flags = ["--out", str(tmp_path / "ro" / "run")] if out else []
    assert cli_main(["run", str(QUICKSTART), *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    who = "--out" if out else "the default run directory"
    assert len(err) == 1 and err[0].startswith(f"error: {who}: cannot create the run directory")
    assert os.strerror(errno.EROFS) in err[0]
