"""``kind: grad_quality``: a setting's numbers depend only on (seed, setting), never on which
other settings are listed or in what order; a setting listed twice is refused."""

import json

import numpy as np
import pytest

from jaxstream.experiment.quality_study import setting_rng
from jaxstream.experiment.registry import get_experiment, load_experiment

TINY = {
    "kind": "grad_quality",
    "seed": 0,
    "model": {"type": "mlp", "width": 8, "depth": 2, "activation": "tanh"},
    "pretrain_steps": 0,
    "micro_batches": 2,
    "microbatch_size": 2,
    "num_exact": 1,
    "num_tangents": 1,
    "tangent_counts": [1],
    "exact_counts": [1],
    "corrections": ["replace"],
    "num_batches": 1,
    "num_seeds": 2,
    "theory_seeds": 0,
}


def _rows(tmp_path, name, settings):
    kind, cfg = load_experiment({**TINY, "settings": settings})
    get_experiment(kind).run(cfg, tmp_path / name)
    return json.loads((tmp_path / name / "quality.json").read_text())


def _of(rows, setting):
    key = lambda r: (r["estimator"], r["num_tangents"], r["num_exact"], r["group"])
    return sorted((r for r in rows if r["setting"] == setting), key=key)


def test_a_settings_numbers_ignore_the_other_settings(tmp_path):
    alone = _rows(tmp_path, "alone", ["shuffled"])
    both = _rows(tmp_path, "both", ["correlated", "shuffled"])
    assert _of(alone, "shuffled") and _of(alone, "shuffled") == _of(both, "shuffled")
    assert {r["setting"] for r in both} == {"correlated", "shuffled"}


def test_setting_generators_are_keyed_by_seed_and_name():
    draw = lambda seed, s: setting_rng(seed, s).integers(0, 2**31, 8)
    assert np.array_equal(draw(0, "shuffled"), draw(0, "shuffled"))  # reproducible
    assert not np.array_equal(draw(0, "shuffled"), draw(0, "correlated"))
    assert not np.array_equal(draw(0, "shuffled"), draw(1, "shuffled"))


def test_a_setting_listed_twice_is_refused():
    with pytest.raises(ValueError, match=r"^settings: 'correlated' is listed twice[^\n]*$"):
        load_experiment({**TINY, "settings": ["correlated", "correlated"]})
    with pytest.raises(ValueError, match=r"^settings: 'shuffled' is listed twice"):
        load_experiment({**TINY, "settings": ["shuffled", "correlated", "shuffled"]})
