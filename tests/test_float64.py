"""Float64 through the in-memory engines: with ``jax_enable_x64`` and float64 parameters, each
engine's gradient is float64 and equals a float64 reference at float64 precision (the losses no
longer cast to float32; the pipeline backward seeds its cotangent in the loss's dtype). The
streamed engines keep a float32 master copy by design (``compute_dtype`` is at most float32)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "float64_worker.py"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res.pop("reference_is_float64") and res.pop("pipeline_forward_is_float64", True)
    for name, (err, is_f64) in res.items():
        assert is_f64, f"{name}: gradient not float64"
        assert err <= 1e-12, f"{name}: relative error {err:.3g} against the float64 reference"


def test_every_engine_at_float64_precision():
    _check()


@pytest.mark.slow
def test_all_exact_hybrids_equal_backprop_at_float64_precision():
    """Every correction (and the pipeline's) with every micro-batch exact equals backprop to
    1e-12 at N = 3, 5, 6, 8: masks, counts, sizes, β and norms are in the parameters' dtype
    (built in float32 they were 3e-8 off unless N is a power of two)."""
    _check("all_exact")
