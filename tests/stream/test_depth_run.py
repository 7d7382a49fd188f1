"""The shipped stochastic-depth run: each step reads and writes only the layers its policy
picked (layers read and parameter bytes per step, from the parameter shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxstream.experiment.runner import load_experiment, run_experiment
from jaxstream.stream.store import LayerStore

CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "stream_stochastic_depth.yaml"


def _nbytes(tree) -> int:
    return sum(int(np.asarray(a).nbytes) for a in jax.tree.leaves(tree))


@pytest.mark.slow  # the whole shipped run: data, compile, 8 steps, evaluation
def test_skipped_layers_are_neither_read_nor_written(tmp_path):
    _, cfg = load_experiment(CONFIG)
    run, summary = run_experiment(CONFIG, ["progress=false", "plots=false"], out=tmp_path / "r")
    assert summary["finished"]
    params = LayerStore.open(run / "stores" / "backprop").read_params()
    ends = _nbytes(params["embed"]) + _nbytes(params["head"])
    num_layers = len(jax.tree.leaves(params["blocks"])[0])
    block = _nbytes(params["blocks"]) // num_layers
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "layers_read" in r]
    assert [r["step"] for r in steps] == list(range(1, cfg.steps + 1))
    picked = [len(cfg.engine.depth.layers(r["step"] - 1, num_layers)) for r in steps]
    assert len(set(picked)) > 1 and max(picked) < num_layers  # the policy skipped layers
    for r, k in zip(steps, picked):
        # backprop: forward k blocks, reverse k - 1 (its first is the forward's last); each
        # picked unit written once; the first step also reads every committed unit once for
        # the divergence guard's norms (the new store records none)
        assert r["layers_read"] == 2 * k - 1
        guard = ends + num_layers * block if r["step"] == 1 else 0
        assert r["bytes_read_params"] == ends + (2 * k - 1) * block + guard
        assert r["bytes_written_params"] == ends + k * block
        # and Adam's state of each picked unit (mu and nu, 2 x its parameters, and an int32
        # count) read and written once
        adam = 2 * (ends + k * block) + 4 * (k + 2)
        assert r["bytes_read"] - r["bytes_read_params"] == adam
        assert r["bytes_written"] - r["bytes_written_params"] == adam
