"""Every YAML in experiments/ parses into its kind's typed config; unknown kinds fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxstream.experiment.config import ConfigError, dump_yaml
from jaxstream.experiment.registry import experiment_kinds, load_experiment

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "experiments").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_parses(path):
    kind, cfg = load_experiment(path)
    assert kind in experiment_kinds()
    # The resolved config is itself a valid experiment file.
    import yaml

    again = load_experiment(yaml.safe_load(dump_yaml(cfg, {"kind": kind})))
    assert again == (kind, cfg)


def test_unregistered_kind_is_a_clear_error(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("kind: no_such_kind\nsteps: 3\n")
    with pytest.raises(ConfigError, match=r"kind: 'no_such_kind' is not a registered experiment "
                                          r"kind; choose one of \[.*'train'.*\]"):
        load_experiment(p)


def test_per_arm_optimizer_overrides_parse():
    """An arm may carry its own optimizer section (its default is None, not a config)."""
    _, cfg = load_experiment(ROOT / "experiments" / "optim_digits.yaml")
    names = [cfg.arm_optimizer(a).name for a in cfg.arms]
    assert names == ["max_adabelief", "max_adabelief", "adabelief", "adabelief", "adam", "adam"]
    assert cfg.arms[0].optimizer is None
