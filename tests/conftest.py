"""Test set-up: eight simulated CPU devices for the sharded engines.

XLA reads the flag once, when JAX first initialises its backends, so it is set here,
before any test module imports JAX.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
