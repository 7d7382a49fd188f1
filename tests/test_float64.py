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


def _check(*args: str) -> set[str]:
    """Runs the worker; checks every result it printed; returns their names."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "float64_worker.py"), *args],
                         capture_output=True, text=True, cwd=ROOT, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    names = set(res) - {"reference_is_float64"}
    assert res.pop("reference_is_float64") and res.pop("pipeline_forward_is_float64", True)
    for name, (err, is_f64) in res.items():
        assert is_f64, f"{name}: gradient not float64"
        assert err <= 1e-12, f"{name}: relative error {err:.3g} against the float64 reference"
    return names


ENGINES = {  # the worker's part (a process each, side by side under xdist) -> what it checks
    "memory": {"in_memory_backprop", "dataparallel_backprop", "dataparallel_forward"},
    "pipeline": {"pipeline_backprop", "pipeline_hybrid_cv", "pipeline_forward_is_float64"},
}


@pytest.mark.parametrize("part", list(ENGINES))
def test_every_engine_at_float64_precision(part):
    assert _check(part) == ENGINES[part]


@pytest.mark.slow
def test_all_exact_hybrids_equal_backprop_at_float64_precision():
    """Every correction (and the pipeline's) with every micro-batch exact equals backprop to
    1e-12 at N = 3, 5, 8 (one partial forward chunk of 4, a full and a partial one, two full
    ones): masks, counts, sizes, β and norms are in the parameters' dtype (built in float32
    they were 3e-8 off unless N is a power of two)."""
    ns = (3, 5, 8)
    names = _check("all_exact", *map(str, ns))
    corrections = ("replace", "control_variate", "weighted", "stein")
    want = {f"all_exact_N{n}_{c}" for n in ns for c in corrections}
    assert names == want | ({"all_exact_N3_pipeline_weighted"} if 3 in ns else set())
