"""``diag_every`` on the engines whose estimate streams on the host (stream, composed): the
cosine of the step's estimate to the exact gradient is logged as on the local engine, equal to
it (the streamed estimate equals the in-memory one). It raised a ConcretizationTypeError after
the first ``diag_every`` steps and left a run directory no run could reuse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxstream.cli import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
TINY = ["steps=4", "eval_every=2", "diag_every=2", "checkpoint_every=0", "model.width=8",
        "model.depth=2", "batch_size=16", "plots=false", "progress=false",
        "arms=[{name: fwd, estimator: {type: forward, num_tangents: 2}, lr: 0.01}]"]


def cosines(run: Path) -> list[float]:
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["cosine"] for r in lines if "cosine" in r]


@pytest.mark.parametrize("engine", ["stream", "composed"])
def test_streamed_diagnostics_equal_the_local_engines(tmp_path, monkeypatch, engine):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(QUICKSTART), *TINY, "--out", "local"]) == 0
    assert main(["run", str(QUICKSTART), *TINY, f"engine={{type: {engine}}}",
                 "--out", engine]) == 0
    local, streamed = cosines(tmp_path / "local"), cosines(tmp_path / engine)
    assert len(local) == len(streamed) == 2
    np.testing.assert_allclose(streamed, local, rtol=1e-4, atol=1e-5)
