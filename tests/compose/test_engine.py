"""The ``composed`` engine in the experiment runner: the shipped config parses, bad meshes
and depths are named before anything is written, and a short run trains from its stores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxstream.experiment.engine_composed import ComposedEngineConfig
from jaxstream.experiment.runner import load_experiment, run_experiment
from jaxstream.stream.store import LayerStore

CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "pipeline_stream.yaml"


def test_shipped_config_parses():
    kind, cfg = load_experiment(CONFIG)
    assert kind == "train" and isinstance(cfg.engine, ComposedEngineConfig)
    assert (cfg.engine.data, cfg.engine.stage) == (2, 4)


@pytest.mark.parametrize("overrides, match", [
    (["engine.stage=3"], r"engine.stage: 3 must divide model.depth = 8"),
    (["engine.data=0"], r"engine.data: must be >= 1, got 0"),
    (["engine.schedule=looped"], (r"engine.schedule: 'looped' is not allowed; choose one of "
                                 r"'circular', 'chunked'")),
    (["engine.prefetch=0"], r"engine.prefetch: the circular schedule .* must be >= 1, got 0"),
    (["engine.prefetch=4"], (r"engine.prefetch: 4 reads past the model's 4 units \(embed, 2 "
                            r"chunks of 4 layers, head\); allowed: 0..3")),
])
def test_bad_mesh_is_named_at_load(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_experiment(CONFIG, overrides)


def test_mesh_larger_than_the_devices_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"engine.mesh: data × stage = 4 × 4 = 16 must divide"):
        run_experiment(CONFIG, ["engine.data=4", "engine.stage=4", "model.depth=4",
                                "progress=false"], out=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_short_run_trains_from_its_stores(tmp_path):
    data = yaml.safe_load(CONFIG.read_text())
    data["arms"] = [a for a in data["arms"] if a["name"] == "hybrid-cv"]
    config = tmp_path / CONFIG.name
    config.write_text(yaml.safe_dump(data))
    _, summary = run_experiment(
        config, ["steps=2", "eval_every=2", "checkpoint_every=2", "plots=false", "progress=false",
                 "model.depth=4", "model.d_model=8", "data.seq_len=8", "data.num_train=64",
                 "data.num_test=16", "batch_size=16", f"engine.store={tmp_path}/s/{{arm}}"],
        out=tmp_path / "run")
    assert summary["finished"]
    lines = [yaml.safe_load(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ticks = {r["ticks"] for r in lines if "ticks" in r}
    # one chunk of 4 stages, 8 micro-batches: forward 8 + 3 ticks, reverse over the 2 selected
    # micro-batches 2 + 3 ticks
    assert ticks == {11 + 5}
    assert LayerStore.open(tmp_path / "s" / "hybrid-cv").step == 2
    assert all(np.isfinite(r["loss"]) for r in lines if "loss" in r)
