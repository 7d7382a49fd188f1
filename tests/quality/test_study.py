"""The ``kind: grad_quality`` study: the shipped config parses, runs tiny, writes its outputs."""

import json
from pathlib import Path

import pytest

from jaxstream.experiment.registry import get_experiment, load_experiment

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "grad_quality_mlp.yaml"
TINY = [
    "model.width=8",
    "model.depth=2",
    "pretrain_steps=2",
    "micro_batches=4",
    "microbatch_size=4",
    "num_exact=2",
    "tangent_counts=[1, 2]",
    "exact_counts=[2]",
    "corrections=[weighted]",
    "num_seeds=4",
    "theory_seeds=4",  # as num_seeds: the seed statistics compile once for both
]


def test_shipped_config_parses():
    kind, cfg = load_experiment(CONFIG)
    assert kind == "grad_quality"
    assert cfg.micro_batches == 16 and cfg.num_exact == 2
    assert set(cfg.corrections) == {"replace", "control_variate", "guess", "weighted"}
    assert set(cfg.settings) == {"correlated", "shuffled"}



def test_the_old_spelling_of_the_micro_batch_count_names_the_new_one():
    import yaml

    data = yaml.safe_load(CONFIG.read_text())
    data["num_microbatches"] = data.pop("micro_batches")
    with pytest.raises(ValueError, match=r"^num_microbatches: renamed micro_batches .*"
                                         r"write micro_batches: 16$"):
        load_experiment(data)


@pytest.mark.parametrize(
    "override, field",
    [
        ("num_exact=0", "num_exact"),
        ("exact_counts=[1, 99]", "exact_counts"),
        ("corrections=[nope]", "corrections.0"),
        ("settings=[sorted]", "settings.0"),
        ("num_seeds=1", "num_seeds"),
        ("colour=red", "colour"),
    ],
)
def test_bad_config_names_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        load_experiment(CONFIG, [override])


def test_study_runs_tiny(tmp_path):
    kind, cfg = load_experiment(CONFIG, TINY)
    summary = get_experiment(kind).run(cfg, tmp_path)
    for name in [
        "quality.json",
        "quality.csv",
        "headline.txt",
        "headline.json",
        "headline.png",
        "vs_tangents.png",
        "vs_exact.png",
        "vs_tangents_per_layer_correlated.png",
        "vs_exact_per_layer_shuffled.png",
        "quality_summary.json",
    ]:
        assert (tmp_path / name).stat().st_size > 0, name
    rows = json.loads((tmp_path / "quality.json").read_text())
    groups = {r["group"] for r in rows}
    assert groups == {"embed", "block_0", "block_1", "head", "all"}
    assert {r["estimator"] for r in rows} == {"forward", "exact subset", "weighted"}
    assert {r["num_tangents"] for r in rows if r["estimator"] == "forward"} == {1, 2}
    assert set(summary["verdict"]) == {"correlated", "shuffled"}
    assert {h["estimator"] for h in summary["headline"]} >= {"forward", "exact subset"}
    theory = summary["gaussian_single_tangent"]
    assert theory["num_parameters"] == summary["num_parameters"]
    assert 0 < theory["cosine_mean"] < 1
    text = (tmp_path / "headline.txt").read_text()
    assert "correlated" in text and "shuffled" in text and "better ingredient" in text
