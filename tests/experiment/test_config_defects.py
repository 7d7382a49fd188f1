"""Config refusals: a file that is not UTF-8 is one line naming it and the byte offset; the
hint on switching a section's type is given only for a key of another type, not a typo."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxstream.cli import main
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.registry import load_experiment

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("latin.yaml").write_bytes(b"kind: train\nsteps: 3 # \xff\n")
    assert main(["run", "latin.yaml", "--out", "o"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: latin.yaml: byte offset 23 (0xff) is not UTF-8; an experiment file "
                   "is UTF-8 text")
    assert not Path("o").exists()


@pytest.mark.parametrize("override, key", [("model.widht=3", "model.widht"),
                                           ("arms.0.estimator.num_tangnets=3",
                                            "arms.0.estimator.num_tangnets")])
def test_a_typo_gets_no_switch_hint(override: str, key: str):
    with pytest.raises(ConfigError) as e:
        load_experiment(QUICKSTART, [override])
    assert f"{key}: unknown key" in str(e.value) and "to switch" not in str(e.value)
