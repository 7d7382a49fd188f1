"""The forward-table benchmark: shipped configs parse; a tiny table runs and writes its rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import forward_table as ft

ARMS = {"BP", "BP-remat", "FG-W", "FG-A", "LG-FG-W", "LG-FG-A", "exact-subset",
        "hybrid-replace", "hybrid-control_variate", "hybrid-weighted", "hybrid-guess"}


@pytest.mark.parametrize("path", [ft.QUICK, ft.FULL])
def test_shipped_tables_parse(path):
    cfg = ft.load_table_config(path)
    assert ARMS <= {a.name for a in cfg.arms}
    assert {"digits", "mnist1d"} <= {d.name for d in cfg.datasets}
    assert cfg.seeds >= 3
    for arm in cfg.arms:
        arm.estimator.build()  # every estimator section builds


def test_bad_table_is_refused_before_compute():
    with pytest.raises(ValueError, match="micro_batches"):
        ft.load_table_config(ft.QUICK, ["datasets.0.batch_size=60"])
    with pytest.raises(ValueError, match="nope"):
        ft.load_table_config(ft.QUICK, ["nope=1"])


def test_tiny_table_runs():
    cfg = ft.load_table_config(ft.QUICK, [
        "seeds=2", "cosine_keys=2", "timing_steps=1", "datasets.0.steps=2",
        "datasets.0.eval_every=2", "datasets.0.train_eval_size=64"])
    (row,) = ft.run_table(cfg, ["digits"], ["BP-remat"])
    assert set(ft.ROW_KEYS) <= set(row) and row["dataset"] == "digits" and row["seeds"] == 2
    assert row["arm"] == "BP-remat" and row["lr"] == cfg.arms[1].lrs[0]
    assert row["cosine_mean"] == pytest.approx(1.0, abs=1e-5)  # exact gradients
    assert row["peak_temp_bytes"] >= 0 and row["step_ms"] > 0
    assert len(row["test_error_by_seed"]) == 2 and len(row["curve_test_error_mean"]) == 1


def test_cli_writes_json_docs_and_plot_from_rows(tmp_path):
    rows = [_row("BP", 0.03), _row("FG-A", 0.05)]
    src = tmp_path / "in.json"
    src.write_text(json.dumps(rows))
    (tmp_path / "in.json.meta").write_text(json.dumps({"command": "c", "machine": "m"}))
    out = tmp_path / "out.json"
    ft.main(["--from-json", str(src), "--json", str(out), "--docs", str(tmp_path / "r.md"),
             "--plot", str(tmp_path / "f.png")])
    assert json.loads(out.read_text()) == rows
    assert (tmp_path / "f.png").stat().st_size > 0
    text = (tmp_path / "r.md").read_text()
    assert "| BP |" in text and "machine: m" in text and "--from-json" in text


def _row(arm, err, sd=0.001, seeds=4):
    return {"dataset": "d", "arm": arm, "lr": 1e-3, "test_error_mean": err, "test_error_sd": sd,
            "train_error_mean": err, "seeds": seeds, "steps": 10, "peak_temp_bytes": 2**20,
            "step_ms": 1.0, "cosine_mean": 0.5, "target_accuracy": 0.9,
            "seeds_reaching_target": 0, "steps_to_target_mean": None, "seconds_to_target": None}


def test_report_checks_follow_the_rows():
    from jaxstream.experiment.table_report import hybrid_verdict, markdown, ordering

    rows = [_row("BP", 0.03), _row("FG-W", 0.20), _row("FG-A", 0.05), _row("LG-FG-A", 0.031),
            _row("exact-subset", 0.04), _row("hybrid-a", 0.025), _row("hybrid-b", 0.041)]
    lines = ordering(rows, "d")
    assert [line.split(":")[1].split()[0] for line in lines] == ["yes", "yes", "yes"]
    rows[2]["test_error_mean"] = 0.25  # FG-A now worse than FG-W
    assert ordering(rows, "d")[0].split(":")[1].split()[0] == "no"
    verdict = hybrid_verdict(rows, "d")
    assert "hybrid-a" in verdict[1] and verdict[1].endswith("BEATS BOTH")
    assert verdict[2].endswith("does not beat both")
    memory = {"rows": [{"depth": 8, "temp_bytes": {"backprop": 4, "backprop_remat": 1, "forward": 1,
                                                   "hybrid": 3, "inference": 1},
                        "step_ms": {"backprop": 2.0, "backprop_remat": 3.0, "forward": 2.0,
                                    "hybrid": 4.0, "inference": 1.0}}]}
    text = markdown({"rows": rows, "command": "c", "machine": "m"}, None, memory)
    assert "| 8 |" in text and "0.250 | 1.50" in text and "Ren" in text
