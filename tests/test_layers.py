"""The house's layers: the lab (``jaxstream_lab``) is built on the library, never the other way
round, and it is found as a plugin, not imported by the core."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved)."""
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + [base])
            out.update([base] + [f"{base}.{a.name}" for a in node.names])
    return out


def test_the_core_never_imports_the_lab():
    core = list((ROOT / "jaxstream").rglob("*.py"))  # the lab is a sibling package
    assert len(core) > 50
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p)
                                                  if m == "jaxstream_lab" or m.startswith("jaxstream_lab."))
                 for p in core}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_cli_finds_the_lab_as_a_plugin_and_the_core_runs_without_it():
    """Importing the core and its runner loads no lab module; loading the plugins (what
    ``jaxstream run`` does) registers ``kind: forward_table`` from the lab."""
    code = ("import sys, jaxstream, jaxstream.experiment.builtin, jaxstream.experiment.runner\n"
            "assert not [m for m in sys.modules if m.startswith('jaxstream_lab')]\n"
            "from jaxstream.experiment.registry import get_experiment\n"
            "print(get_experiment('forward_table').config_cls.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "jaxstream_lab.table_config"  # the lab's, not the core's
