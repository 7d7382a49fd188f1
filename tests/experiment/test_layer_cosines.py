"""Per-layer diagnostics of ``kind: train``: every ``diag_every`` steps each segment's cosine
to the exact gradient, and for local-loss estimators to the local target beside it."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from jaxstream.experiment.rundir import MetricsLog
from jaxstream.experiment.runner import run_experiment


def test_layer_cosines_are_logged_and_plotted(tmp_path):
    cfg = {"kind": "train", "seed": 0, "steps": 4, "batch_size": 16, "eval_every": 2,
           "diag_every": 2, "progress": False,
           "model": {"type": "mlp", "width": 8, "depth": 2},
           "arms": [{"name": "bp", "estimator": {"type": "backprop"}, "lr": 0.01},
                    {"name": "lg", "lr": 0.01, "estimator": {
                        "type": "forward", "perturb": "activations", "local_losses": True,
                        "num_tangents": 4}}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run_dir, _ = run_experiment(path, out=tmp_path / "run")
    recs = [r for r in MetricsLog(run_dir / "metrics.jsonl").read() if "cosine" in r]
    segments = ("embed", "block_0", "block_1", "head")
    bp = [r for r in recs if r["arm"] == "bp"]
    lg = [r for r in recs if r["arm"] == "lg"]
    assert len(bp) == len(lg) == 2
    for r in bp:  # exact gradients: every layer's cosine is 1, no local target
        for s in segments:
            assert r[f"cosine_{s}"] == pytest.approx(1.0, abs=1e-5)
        assert not any(k.startswith("local_cosine") for k in r)
    for r in lg:
        values = [r[f"cosine_{s}"] for s in segments] + [r[f"local_cosine_{s}"] for s in segments]
        assert all(-1.0 <= v <= 1.0 for v in values)
        # the head's local loss is the global loss, and (a shared head) so is the last
        # block's: for these two segments both cosines are one number
        assert r["local_cosine_head"] == pytest.approx(r["cosine_head"], abs=1e-6)
        assert r["local_cosine_block_1"] == pytest.approx(r["cosine_block_1"], abs=1e-5)
        # a block's estimate is closer to its local target than to the global gradient
        # (4 tangents on its own loss; its own loss is not the global one)
        assert np.mean([r[f"local_cosine_{s}"] for s in segments[:-1]]) > np.mean(
            [r[f"cosine_{s}"] for s in segments[:-1]])
    assert (run_dir / "cosine_layers.png").stat().st_size > 0
