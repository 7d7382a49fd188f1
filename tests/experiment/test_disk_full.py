"""A full disk at any write of a local run (the orbax checkpoint, metrics.jsonl, the plots,
summary.json) ends ``jaxstream run`` with one line and exit status 2, nothing printed at
interpreter exit, and the last checkpoint intact: ``--resume`` finishes the run.

The writer at each point raises what the machine raises on a full disk: orbax's
``ValueError: RESOURCE_EXHAUSTED`` from TensorStore, ``OSError(ENOSPC)`` from a file write."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from jaxstream.cli import main as cli_main
from jaxstream.experiment.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
CFG = ["steps=6", "eval_every=2", "diag_every=0", "checkpoint_every=2", "model.width=8",
       "model.depth=1", "batch_size=16", "progress=false",
       "arms=[{name: backprop, estimator: {type: backprop}, lr: 0.01}]"]


def _enospc(*_: Any, **__: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullFile:
    """A file opened for appending on a full disk: every write fails."""

    def __init__(self, f: Any):
        self.f = f

    def __enter__(self) -> _FullFile:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    write = staticmethod(_enospc)


def install(point: str, setattr: Callable[[Any, str, Any], None]) -> None:
    """Fills the disk at ``point``: the checkpoint of step 4, the metrics log once it holds a
    few records, the plots, the summary."""
    if point == "orbax":
        import orbax.checkpoint as ocp

        save = ocp.CheckpointManager.save

        def full_save(self: Any, step: int, *a: Any, **k: Any) -> Any:
            if step == 4:
                raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "4/state": '
                                 "Failed writing: [OS error 28: No space left on device]")
            return save(self, step, *a, **k)

        setattr(ocp.CheckpointManager, "save", full_save)
    elif point == "metrics":
        opened = pathlib.Path.open

        def full_open(self: Path, mode: str = "r", *a: Any, **k: Any) -> Any:
            f = opened(self, mode, *a, **k)
            if self.name == "metrics.jsonl" and mode == "a" and self.stat().st_size > 600:
                return _FullFile(f)
            return f

        setattr(pathlib.Path, "open", full_open)
    elif point == "plots":
        import matplotlib.figure

        setattr(matplotlib.figure.Figure, "savefig", _enospc)
    elif point == "summary":
        written = pathlib.Path.write_text

        def full_write(self: Path, *a: Any, **k: Any) -> Any:
            if self.name == "summary.json.tmp":
                _enospc()
            return written(self, *a, **k)

        setattr(pathlib.Path, "write_text", full_write)


def _check_line(lines: list[str], out: Path, point: str) -> None:
    assert len(lines) == 1 and lines[0].startswith("error: No space left on device: "), lines
    assert "--resume" in lines[0]
    saved = sorted(int(p.name) for p in (out / "checkpoints" / "backprop").iterdir()
                   if p.name.isdigit())
    if point == "orbax":
        assert saved == [2] and "checkpoint at step 2 is intact" in lines[0]
        assert str(out / "checkpoints" / "backprop" / "4") in lines[0]
    else:
        assert str(out) in lines[0] and saved


@pytest.mark.slow
def test_a_full_disk_at_the_orbax_save_in_a_process(tmp_path):
    """The whole process: exactly one line on stderr (besides status lines), exit status 2,
    nothing at interpreter exit (orbax's threads closed), then --resume finishes the run."""
    out = tmp_path / "run"
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from tests.experiment.test_disk_full import install\n"
            "install('orbax', setattr)\n"
            "from jaxstream.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, "run", str(QUICKSTART), *CFG, "--out",
                           str(out)], capture_output=True, text=True, check=False, cwd=tmp_path,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)
    assert proc.returncode == 2, proc.stderr
    _check_line([ln for ln in proc.stderr.splitlines() if not ln.startswith("jaxstream: ")],
                out, "orbax")
    _, summary = run_experiment(QUICKSTART, CFG, out=out, resume=True)
    assert summary["finished"]


@pytest.mark.parametrize("point", ["orbax", "metrics", "plots", "summary"])
def test_a_full_disk_is_one_line_and_the_run_resumes(tmp_path, point, monkeypatch, capsys):
    """In this process: each write point's full disk is one ``error:`` line, exit status 2;
    the run resumes from what it left."""
    install(point, monkeypatch.setattr)
    out = tmp_path / "run"
    assert cli_main(["run", str(QUICKSTART), *CFG, "--out", str(out)]) == 2
    _check_line([ln for ln in capsys.readouterr().err.splitlines()
                 if not ln.startswith("jaxstream: ")], out, point)
    monkeypatch.undo()
    if point in ("metrics", "summary"):  # one write point during training, one after it
        _, summary = run_experiment(QUICKSTART, CFG, out=out, resume=True)
        assert summary["finished"]
        assert json.loads((out / "summary.json").read_text())["finished"]
