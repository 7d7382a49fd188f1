"""benchmarks/draws.py at a small size: every draw timed, and a library draw that differs from
its jax.random baseline is refused before anything is timed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))


def test_draws_rows(tmp_path):
    import draws

    out = draws.main(["--size", "5000", "--draws", "2", "--rounds", "1",
                      "--json", str(tmp_path / "d.json")])
    assert set(out["ms"]) == set(draws.DRAWS) and all(t > 0 for t in out["ms"].values())
    assert json.loads((tmp_path / "d.json").read_text())["size"] == 5000
    assert "| gaussian, jax.random.normal |" in draws.table(out["ms"])


def test_the_table_goes_into_its_doc_block(tmp_path):
    import draws

    doc = tmp_path / "d.md"
    doc.write_text("before\n<!-- generated: draws.py table -->\nold\n<!-- end generated -->\n")
    draws.main(["--size", "5000", "--draws", "1", "--rounds", "1", "--doc", str(doc)])
    text = doc.read_text()
    assert "old" not in text and "| rademacher |" in text and text.startswith("before\n")
    assert "Written by `python benchmarks/draws.py --size 5000" in text


def test_a_draw_unlike_its_baseline_is_refused(monkeypatch):
    import draws

    monkeypatch.setitem(draws.DRAWS, "gaussian", lambda k, n: jnp.zeros((1, n)))
    with pytest.raises(AssertionError, match="gaussian: the library's draw differs"):
        draws.measure(5000, 1, 1)
