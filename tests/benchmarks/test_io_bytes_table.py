"""benchmarks/io_bytes.py: its arguments and its table (the counts are tests/stream's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import io_bytes as iob


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--width", "0"], ["--optimizer", "lion"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        iob.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_table_row_per_estimator_in_kib():
    row = {"estimator": "hybrid lazy", "layers_read": 15.0, "bytes_read_per_layer": 2048.0,
           "bytes_written_per_layer": 1024.0, "bytes_written_pending": 512.0,
           **{f"bytes_{w}_{k}": 0.0 for w in ("read", "written") for k in iob.KINDS}}
    row["bytes_read_carry"] = 3072.0
    lines = iob.table([row]).splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[2].count("|")
    assert lines[2].startswith("| hybrid lazy | 15 | 2.0 | 1.0 |")
    assert "| 3.0 / 0.0 |" in lines[2] and lines[2].endswith("| 0.5 |")
