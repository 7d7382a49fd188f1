"""Run a notebook and read the numbers behind the claims its text makes.

Each notebook ends with a cell that prints one line ``claims: {json}``: the numbers its prose
states results about. The tests check every claim against those numbers, both in the outputs
committed with the notebook (what a reader sees) and in a fresh execution (what the code gives
today), so a sentence that stops being true fails a test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
MARK = "claims: "
#: Two-sided level of each "mean exceeds its noise" check (a fixed seed makes a run
#: deterministic; the level says how far from zero a mean must be to count as a gain).
ALPHA = 1e-3
#: Standard errors a mean must exceed to count as non-zero at level ``ALPHA``.
Z = float(stats.norm.ppf(1 - ALPHA / 2))


def committed(path: Path) -> Any:
    """The notebook as committed, with its outputs."""
    return nbformat.read(path, as_version=4)


def execute(path: Path, monkeypatch: Any, cwd: Path = ROOT, timeout: int = 600,
            env: dict[str, str] | None = None) -> Any:
    """Execute ``path`` top to bottom in a fresh kernel (the checkout importable, JAX on the
    CPU, the inline backend) and return the executed notebook."""
    py = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{py}" if py else str(ROOT))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    nb = nbformat.read(path, as_version=4)
    # "python3" is the venv's own kernel spec (ipykernel installs it).
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def text(nb: Any) -> str:
    """All stream text printed by the code cells."""
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))


def images(nb: Any) -> int:
    """Number of PNG outputs."""
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def claims(nb: Any) -> dict[str, Any]:
    """The ``claims: {json}`` line the notebook printed (exactly one)."""
    lines = [ln[len(MARK):] for ln in text(nb).splitlines() if ln.startswith(MARK)]
    assert len(lines) == 1, f"expected one '{MARK}...' line in the outputs, got {len(lines)}"
    return json.loads(lines[0])


def unexecuted(nb: Any) -> list[int]:
    """Indices of code cells never executed or with an error output; -1 if the cells ran out of
    order (a notebook committed after a clean top-to-bottom run has none)."""
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    bad = [i for i, c in code if c.get("execution_count") is None]
    counts = [c.get("execution_count") or 0 for _, c in code]
    if counts != sorted(counts) or len(set(counts)) != len(counts):
        bad.append(-1)
    errors = [i for i, c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    return bad + errors


def exceeds(mean: float, se: float, z: float = Z) -> bool:
    """``mean`` is above zero by more than ``z`` standard errors."""
    return mean > z * se
