"""Float64 through the in-memory engines: with ``jax_enable_x64`` and float64 parameters, each
engine's gradient is float64 and equals a float64 reference at float64 precision (the losses no
longer cast to float32; the pipeline backward seeds its cotangent in the loss's dtype). The
streamed engines keep a float32 master copy by design (``compute_dtype`` is at most float32)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_engine_at_float64_precision():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "float64_worker.py")],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res.pop("reference_is_float64") and res.pop("pipeline_forward_is_float64")
    for name, (err, is_f64) in res.items():
        assert is_f64, f"{name}: gradient not float64"
        assert err <= 1e-12, f"{name}: relative error {err:.3g} against the float64 reference"
