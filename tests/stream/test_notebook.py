"""notebooks/03_streaming.ipynb: committed with its outputs, runs top to bottom, and what its text
states about the streamed steps holds for the numbers it prints."""

from __future__ import annotations

from typing import Any

import pytest

from tests import notebook_claims as nbc

NOTEBOOK = nbc.ROOT / "notebooks" / "03_streaming.ipynb"


def check_claims(c: dict[str, Any]) -> None:
    """Each stated result, against the notebook's numbers."""
    n = c["num_layers"]
    # Every step reads each layer once ...
    assert c["layers_read"] == [n] * c["steps"]
    units = c["last_step_units"]
    forward = [layer for sweep, part, layers in units if sweep == "forward" and part == "block"
               for layer in layers]
    assert sorted(forward) == list(range(n))
    # ... and, with lazy updates, has no update sweep (every unit's update waits for its read).
    assert [u for u in units if u[0] != "forward"] == [], units
    assert [part for _, part, _ in units] == ["embed", *["block"] * len(forward), "head"]
    # The store's committed step is the number of steps run.
    assert c["committed_step"] == c["steps"]


def test_committed_with_outputs_whose_claims_hold():
    nb = nbc.committed(NOTEBOOK)
    assert nbc.unexecuted(nb) == []
    assert nbc.images(nb) >= 1
    check_claims(nbc.claims(nb))


@pytest.mark.slow  # executes the notebook: under a minute on 2 CPU cores
def test_streaming_notebook_runs_and_its_claims_hold(monkeypatch, tmp_path):
    nb = nbc.execute(NOTEBOOK, monkeypatch, cwd=tmp_path, timeout=300)
    out = nbc.text(nb)
    assert "committed step 6" in out and "predicted" in out
    assert nbc.images(nb) >= 1
    check_claims(nbc.claims(nb))
