"""A store handed over (``continue_store``) to a run at another learning rate: the deferred
(lazy) updates it holds are updates of steps already committed at the old rate, and are applied
at that rate before the new run trains on, so the lazy run equals the eager one. They were
applied at the new rate: at step 6 the loss was 21.7 against 8.09."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxstream.cli import main

QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
TINY = ["steps=6", "eval_every=3", "diag_every=0", "checkpoint_every=3", "model.width=16",
        "model.depth=3", "batch_size=32", "plots=false", "progress=false",
        "optimizer={name: sgd}"]


def arm(lr: float) -> str:
    return f"arms=[{{name: fwd, estimator: {{type: forward, num_tangents: 2}}, lr: {lr}}}]"


def losses(run: Path) -> list[float]:
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "loss" in r and "lost" not in r]


def test_a_lazy_store_handed_over_at_another_rate_equals_the_eager_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = {}
    for update in ("eager", "lazy"):
        store = tmp_path / f"store_{update}"
        engine = f"engine={{type: stream, update: {update}, store: '{store}'}}"
        assert main(["run", str(QUICKSTART), *TINY, engine, arm(0.001), "max_steps=2",
                     "--out", f"first_{update}"]) == 0
        engine = engine[:-1] + ", continue_store: true}"
        assert main(["run", str(QUICKSTART), *TINY, engine, arm(0.5),
                     "--out", f"second_{update}"]) == 0
        out[update] = losses(tmp_path / f"second_{update}")
    assert len(out["eager"]) == 4
    np.testing.assert_allclose(out["lazy"], out["eager"], rtol=1e-5)
