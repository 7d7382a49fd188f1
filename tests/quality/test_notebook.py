"""The forward-vs-backprop notebook runs top to bottom (small settings)."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01_forward_vs_backprop.ipynb"


def test_notebook_runs(monkeypatch):
    # The kernel is a subprocess: make the checkout importable and keep JAX on the CPU.
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{path}" if path else str(ROOT))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel uses its inline backend
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # "python3" is the venv's own kernel spec (ipykernel installs it; jupyter_client also
    # provides it natively for the running interpreter).
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "forward K=1" in outputs and "cosine" in outputs
    assert "theory sqrt(2/(pi n))" in outputs
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 2
