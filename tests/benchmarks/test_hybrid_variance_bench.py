"""benchmarks/hybrid_variance.py: bad arguments are refused in one line before any compute, and
the regime table's pick is the row closest to a win."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import hybrid_variance as bench


@pytest.mark.parametrize("args,field", [(["--n", "7"], "--n"), (["--seeds", "3"], "--seeds"),
                                        (["--doc", "no/such.md"], "--doc")])
def test_bad_arguments_exit_2_naming_the_field(args, field):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hybrid_variance.py"), *args],
                         check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "error:" in last and field in last


def test_pick_is_the_lowest_ratio_and_the_table_says_when_the_subset_is_backprop():
    rows = [{"ratio": math.inf}, {"ratio": 17.4}, {"ratio": 33.0}]
    assert bench.pick(rows)["ratio"] == 17.4
    assert bench.ratio(math.inf).startswith("∞") and bench.ratio(17.4) == "17.4"


def test_json_has_no_infinity():
    import json

    text = json.dumps(bench.finite({"rows": [{"ratio": math.inf, "S": 2}], "x": (1.5,)}))
    assert "Infinity" not in text and json.loads(text)["rows"][0]["ratio"] is None
