"""Test set-up: eight simulated CPU devices for the sharded engines, compiled fast.

XLA reads the flag once, when JAX first initialises its backends, so it is set here,
before any test module imports JAX.
"""

import os


def _xla_flags() -> str:
    """Eight simulated CPU devices, and XLA's older loop emitters for fused elementwise code
    where this XLA still has them (``--xla_cpu_use_fusion_emitters=false``: the same
    computation, compiled in about two thirds of the time; temporary buffers within a few
    hundred bytes of the default's, and the benchmarks never set it). XLA aborts on a flag it
    does not know, so a short subprocess checks that it does first."""
    import subprocess
    import sys

    devices, fast = "--xla_force_host_platform_device_count=8", "--xla_cpu_use_fusion_emitters=false"
    probe = subprocess.run([sys.executable, "-c", "import jax.numpy as j; j.zeros(1).block_until_ready()"],
                           env={**os.environ, "XLA_FLAGS": f"{devices} {fast}", "JAX_PLATFORMS": "cpu"},
                           capture_output=True, timeout=120, check=False)
    return f"{devices} {fast}" if probe.returncode == 0 else devices


if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = _xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")
# Most of XLA's optimisations off (LLVM's level 0, its expensive passes skipped): the suite
# is compile-bound (about 80 % of a worker's time is XLA's backend compile), and this halves
# that time. What runs at the default options, as a user's process has them: the test about
# XLA's own code generation (tests/test_xla_guard.py) and the float64 precision workers
# (tests/float64_worker.py, tests/grad/spsa_float64_worker.py): at LLVM's level 0 two programs
# computing the same float64 loss differed in its last digits (a data-parallel SPSA estimate
# then by 8.5e-8 from the in-memory one, 7e-14 at the default). Set
# JAX_DISABLE_MOST_OPTIMIZATIONS=0 to run the whole suite at the default.
# XLA's CPU compiler has segfaulted inside a compile now and then, at either level (a dozen
# idle host-update threads of executors in the process each time); the rerun of a test whose
# worker died (reruns = 2, pyproject.toml) covers it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# No persistent compilation cache: jaxlib writes a cache entry in place, so a reader of an entry
# still being written can crash in deserialisation. Seen with one cache for both xdist workers
# (a segfault in the engine matrix) and again with a cache per test process: the streamed
# executors compile on their own threads (host updates, prefetch), and a host-update thread
# aborted reading an entry (jax's compilation_cache.get_executable_and_time). A cache per
# process saved about 12 % of CPU; not worth a crash.


import pytest  # after the XLA flags: importing it does not import JAX


@pytest.fixture(autouse=True)
def strict_dtype_promotion(request):
    """Every test runs under strict dtype promotion (as equinox's do): an implicit upcast (int
    with float, bf16 with fp32) in the library fails loudly instead of silently changing
    precision. The optimizers the library builds run optax's own arithmetic under standard
    promotion (:func:`jaxstream.experiment.optimizers.standard_promotion`); a test whose own
    code steps a bare optax optimizer opts out with ``@pytest.mark.standard_promotion``."""
    import jax

    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield

# jaxlib 0.10.2's CPU backend miscompiles some vmapped reductions (jaxstream.xla_guard): the
# guard adds its flag to XLA_FLAGS, which must happen before any test module starts JAX.
import jaxstream  # noqa: F401
