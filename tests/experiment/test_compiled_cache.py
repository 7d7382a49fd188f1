"""The runner's per-process caches are keyed by the configs themselves: two configs loaded
separately but equal (a dict field included) share one built model and one local engine;
a config that differs in any field, a dict entry included, gets its own."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from jaxstream.experiment import compiled
from jaxstream.experiment.registry import load_experiment
from jaxstream.experiment.train_config import TrainConfig

QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
INFO = {"in_dim": 64, "num_classes": 10}
SGD = ["optimizer.name=sgd", "optimizer.options={momentum: 0.9}"]


def _load(*overrides: str) -> TrainConfig:
    kind, cfg = load_experiment(QUICKSTART, ["model.width=16", *overrides])
    assert kind == "train"
    return cfg


def test_every_config_is_hashable_and_its_dicts_read_only():
    cfg = _load(*SGD)
    assert hash(cfg) == hash(_load(*SGD)) and cfg == _load(*SGD)
    assert dict(cfg.optimizer.options) == {"momentum": 0.9}
    assert repr(cfg.optimizer.options) == "{'momentum': 0.9}"  # one line in a message
    copied = pickle.loads(pickle.dumps(cfg))  # as a process pool passes it
    assert copied == cfg and hash(copied) == hash(cfg) and repr(copied) == repr(cfg)
    with pytest.raises(TypeError):
        cfg.optimizer.options["momentum"] = 0.5


def test_equal_configs_share_a_model_and_an_engine_and_unequal_ones_do_not():
    a, b = _load(*SGD), _load(*SGD)
    assert a is not b
    model = compiled.model_for(a, INFO)
    assert compiled.model_for(b, INFO) is model
    assert compiled.model_for(_load("model.width=24"), INFO) is not model
    arm = a.arms[0]
    engine = compiled.engine_for(a, arm, model)
    assert compiled.engine_for(b, b.arms[0], model) is engine
    other = _load("optimizer.name=sgd", "optimizer.options={momentum: 0.5}")
    assert compiled.engine_for(other, other.arms[0], model) is not engine
