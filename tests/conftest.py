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
                           capture_output=True, timeout=120)
    return f"{devices} {fast}" if probe.returncode == 0 else devices


if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = _xla_flags()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")
# The suite compiles hundreds of small programs and runs each a few times, so compiling is most
# of its time: LLVM's expensive passes are left out (jax_disable_most_optimizations; the HLO, its
# buffers and so every memory figure a test checks are XLA's own). Inherited by the
# subprocesses the tests start. The benchmarks never set it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# One compilation cache per test run, shared by the xdist workers and the subprocesses they
# start (notebooks, multi-process and float64 runs compile programs another test already
# compiled). Keyed by the run's id, removed when the run ends.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"solo-{os.getpid()}"
_CACHE = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jaxstream-test-jit-{_RUN}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")


def pytest_sessionfinish(session, exitstatus):
    """The run's compilation cache goes with it (the xdist controller, or a run without
    workers, removes it)."""
    import shutil

    if not os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("JAX_COMPILATION_CACHE_DIR") == _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)
