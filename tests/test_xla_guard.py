"""The guard against jaxlib 0.10.2's CPU miscompilation of vmapped reductions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxstream import xla_guard


def test_this_process_computes_the_reproducer_right():
    """The suite runs with the guard (conftest imports jaxstream before JAX starts): the
    layer-norm pullback vmapped over 100 cotangents equals its rows computed one by one."""
    assert not xla_guard.miscompiles()


def _run(code: str) -> subprocess.CompletedProcess:
    # XLA's default options, as a user's process has them (the suite compiles with most
    # optimisations off: tests/conftest.py)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    return subprocess.run([sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.skipif(not xla_guard.flag_applies(xla_guard._jaxlib_version()),
                    reason="this jaxlib does not know the flag")
def test_importing_jaxstream_first_sets_the_flag_and_late_import_warns_by_name():
    first = _run("import os, jaxstream; from jaxstream.xla_guard import miscompiles; "
                 "print(jaxstream.XLA_GUARD, miscompiles(), os.environ['XLA_FLAGS'])")
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[:2] == ["set", "False"]
    assert xla_guard.FLAG in first.stdout
    late = _run("import jax.numpy as j; j.zeros(1).block_until_ready(); import jaxstream; "
                "print(jaxstream.XLA_GUARD)")
    assert late.returncode == 0, late.stderr
    assert late.stdout.split() == ["late"]
    assert xla_guard.FLAG in late.stderr and "RuntimeWarning" in late.stderr
    own = _run("import os; os.environ['XLA_FLAGS'] = "
               "'--xla_cpu_experimental_ynn_fusion_type=reduce'; import jaxstream; "
               "print(jaxstream.XLA_GUARD)")
    assert own.stdout.split() == ["present"]  # a user's own choice of the fusion is kept


def test_versions_are_read_and_bounded():
    assert xla_guard._version("0.10.2") == (0, 10, 2)
    assert xla_guard._version("0.11.0rc1") == (0, 11, 0)
    assert xla_guard.flag_applies((0, 10, 2)) and xla_guard.flag_applies((0, 11, 1))
    assert not xla_guard.flag_applies((0, 10, 1)) and not xla_guard.flag_applies(None)
