"""Under ``jax_enable_x64`` the seed statistics of float64 estimates keep float64: bias,
variance and SNR against float64 NumPy formulas, on estimates a float32 cast would ruin (a large
common offset with a tiny spread: variance 320x off, bias 157x). In a process of its own (the
x64 flag is global)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CODE = textwrap.dedent('''
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jaxstream.quality import seed_statistics

    rng = np.random.default_rng(0)
    exact = 1e4 + rng.normal(size=50)
    est = exact[None] + 1e-4 * rng.normal(size=(64, 50))
    st = seed_statistics({"w": jnp.asarray(est)}, {"w": jnp.asarray(exact)})
    var = est.var(0, ddof=1).sum()
    print(json.dumps({
        "dtype": str(st.variance["all"].dtype),
        "variance": [float(st.variance["all"]), var],
        "bias": [float(st.bias["all"]),
                 np.linalg.norm(est.mean(0) - exact) / np.linalg.norm(exact)],
        "snr": [float(st.snr["all"]), (exact ** 2).sum() / var]}))
''')


def test_float64_estimates_keep_float64_statistics():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got.pop("dtype") == "float64"
    # the bias is a difference of means near 1e4 that differ by ~1e-5: float64 rounding leaves
    # about 2e-16 * 1e4 / 1e-5 = 2e-7 of it; float32 left it 157x off
    for name, (lib, ref) in got.items():
        assert abs(lib - ref) <= 1e-6 * abs(ref), (name, lib, ref)
