"""A train run's accuracy plot draws a target line only where the metric has one: a classifier's
default target, or one a character model's config sets itself."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxstream.experiment import plots
from jaxstream.experiment.data_configs import CharsDataConfig, DigitsDataConfig
from jaxstream.experiment.train_config import TrainConfig


def labels(data) -> np.ndarray:
    return data.dataset(0).train["y"]


def target_lines(monkeypatch, tmp_path, target) -> list[str]:
    """Labels of the dashed horizontal target lines in ``test_accuracy.png``'s panels."""
    seen: list[str] = []
    save = plots._save

    def spy(fig, path, layout=True):
        if path.name == "test_accuracy.png":
            seen.extend(ln.get_label() for ax in fig.axes for ln in ax.get_lines()
                        if ln.get_label().startswith("target"))
        return save(fig, path, layout)

    monkeypatch.setattr(plots, "_save", spy)
    records = [{"arm": "a", "step": s, "loss": 2.0 - s / 10, "test_accuracy": 0.1 * s,
                "train_time": 0.01 * s} for s in range(10)]
    plots.write_plots(records, ["a"], tmp_path, target)
    return seen


def test_character_model_has_no_default_target(monkeypatch, tmp_path):
    chars = CharsDataConfig(seq_len=8, num_train=32, num_test=16)
    cfg = TrainConfig(data=chars, batch_size=16)
    y = labels(chars)
    assert y.ndim == 2  # a label per position: next-character accuracy
    assert plots.plotted_target(cfg, y) is None
    assert target_lines(monkeypatch, tmp_path, plots.plotted_target(cfg, y)) == []
    # A target the config sets itself is drawn.
    own = dataclasses.replace(cfg, target_accuracy=0.4)
    assert plots.plotted_target(own, y) == 0.4
    assert target_lines(monkeypatch, tmp_path, 0.4) == ["target 40%"] * 2


def test_classifier_keeps_its_target(monkeypatch, tmp_path):
    cfg = TrainConfig()
    y = labels(DigitsDataConfig())
    assert y.ndim == 1
    assert plots.plotted_target(cfg, y) == cfg.target_accuracy
    assert target_lines(monkeypatch, tmp_path, cfg.target_accuracy) == ["target 95%"] * 2


def test_compare_draws_the_line_the_run_drew(monkeypatch, tmp_path):
    """``jaxstream compare`` of character-model runs draws no 95 % line either."""
    import json

    from jaxstream.experiment import doctable

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"arm": "a", "step": s, "loss": 1.0, "test_accuracy": 0.1 * s,
                    "train_time": 0.01 * s}) + "\n" for s in range(5)))
    drawn = []
    monkeypatch.setattr(plots, "write_compare_plot",
                        lambda records, arms, path, target: drawn.append(target))
    for summary, want in [({"target_accuracy": 0.95, "plotted_target": None}, None),
                          ({"target_accuracy": 0.95, "plotted_target": 0.95}, 0.95),
                          ({"target_accuracy": 0.9}, 0.9)]:  # a run from before the field
        (run / "summary.json").write_text(json.dumps({**summary, "arms": {}}))
        doctable.compare_runs([run], plot=tmp_path / "c.png")
        assert drawn[-1] == want
