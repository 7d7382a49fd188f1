"""The forward-table benchmark: shipped configs parse; a tiny table runs and writes its rows;
``jaxstream run`` runs a tiny table end to end, a data set judged by loss included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.markdown import compact

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import forward_table as ft

#: The test rows' arms in the parts they play, as a table's ``report:`` section says (the
#: report knows no arm by name).
SECTION = {"reference": "BP",
           "methods": {"BP": ["BP"], "FG-W": ["FG-W"], "FG-A": ["FG-A"],
                       "LG-FG-A": ["LG-FG-A-Ren", "LG-FG-A", "LG-FG-A-Ren-G16"]},
           "forward": ["FG-W", "FG-A", "LG-FG-A", "LG-FG-A-Ren"], "exact_subset": "exact-subset",
           "hybrids": ["hybrid-a", "hybrid-b", "hybrid-x"],
           "shared_head": ["LG-FG-A", "LG-FG-A-Ren"], "base_design": "LG-FG-A-Ren",
           "designs": ["LG-FG-A-Ren-G4", "LG-FG-A-Ren-P16G4-agg"]}


def _report():
    from jaxstream.experiment.config import from_dict
    from jaxstream_lab.table_config import TableReport

    return from_dict(TableReport, SECTION)


ARMS = {"BP", "BP-remat", "FG-W", "FG-A", "LG-FG-W", "LG-FG-A", "exact-subset",
        "hybrid-replace", "hybrid-control_variate", "hybrid-weighted", "hybrid-guess"}


@pytest.mark.parametrize("path", [ft.QUICK, ft.FULL])
def test_shipped_tables_parse(path):
    cfg = ft.load_table_config(path)
    assert ARMS <= {a.name for a in cfg.arms}
    assert {"digits", "mnist1d"} <= {d.name for d in cfg.datasets}
    if path == ft.FULL:  # the char transformer on the text corpus, judged by test loss
        (text,) = [d for d in cfg.datasets if d.name == "text"]
        assert text.metric == "loss" and text.model.depth <= 2 and text.data.seq_len == 32
    assert cfg.seeds >= 3
    for arm in cfg.arms:
        arm.estimator.build()  # every estimator section builds


def test_bad_table_is_refused_before_compute():
    with pytest.raises(ValueError, match="micro_batches"):
        ft.load_table_config(ft.QUICK, ["datasets.0.batch_size=60"])
    with pytest.raises(ValueError, match="nope"):
        ft.load_table_config(ft.QUICK, ["nope=1"])
    with pytest.raises(ValueError, match=r"datasets\.0\.metric: 'accuracy' is not allowed; choose one of 'error', 'loss'"):
        ft.load_table_config(ft.QUICK, ["datasets.0.metric=accuracy"])
    with pytest.raises(ValueError, match=r"datasets\.0\.target_loss: metric 'loss' needs a positive target"):
        ft.load_table_config(ft.QUICK, ["datasets.0.metric=loss"])
    # the report section names arms of the table: a typo, or arms overridden without it
    with pytest.raises(ValueError, match=r"report\.hybrids\.1: 'hybrid-wieghted' is not an arm "
                                         r"of the table; allowed: \['BP', "):
        ft.load_table_config(ft.QUICK, ["report.hybrids=[hybrid-replace, hybrid-wieghted]"])
    with pytest.raises(ValueError, match=r"report\.methods\.FG-X: not a published method; "
                                         r"allowed: \['BP', 'FG-W', 'FG-A', 'LG-FG-W', 'LG-FG-A'\]"):
        ft.load_table_config(ft.QUICK, ["report.methods={FG-X: [FG-W]}"])
    with pytest.raises(ValueError, match=r"report\.reference: 'BP' is not an arm of the table;"
                                         r".*report=\{\}"):
        ft.load_table_config(ft.QUICK, ["arms=[{name: B, estimator: {type: backprop}}]"])


def test_cli_runs_a_tiny_table_judged_by_loss(tmp_path):
    """``jaxstream run`` on the quick table, shrunk to a tiny MLP on digits judged by loss (as
    the char transformer on text is in the full table) and one arm with two learning rates: the
    run directory gets its rows, report and plot; the rate picked is the one with the lowest
    mean final train loss."""
    from jaxstream.cli import main

    text = ("[{name: dl, data: {type: digits}, model: {type: mlp, width: 8, depth: 1}, "
            "steps: 4, batch_size: 8, eval_every: 2, train_eval_size: 32, metric: loss, "
            "target_loss: 9.0}]")
    arms = "[{name: BP, estimator: {type: backprop}, lrs: [0.00001, 0.03]}]"
    out = tmp_path / "run"
    assert main(["run", str(ft.QUICK), "--out", str(out), "seeds=2", "cosine_keys=1",
                 "timing_steps=1", "extend_sweeps=0", f"datasets={text}", f"arms={arms}",
                 "report={reference: BP}"]) == 0
    *base, row = json.loads((out / "rows.json").read_text())
    assert [b["arm"] for b in base] == ["chance", "logistic regression"]
    assert {b["metric"] for b in base} == {"loss"}  # judged as the data set is
    assert row["dataset"] == "dl" and row["metric"] == "loss" and row["seeds"] == 2
    losses = row["train_loss_by_lr"]
    assert row["lr"] == row["lrs"][losses.index(min(losses))]
    assert losses[1] < losses[0]  # 4 Adam steps at 3e-2 lower the loss more than at 1e-5
    assert row["train_loss_mean"] == pytest.approx(min(losses))
    assert row["test_loss_sd"] > 0 and len(row["test_loss_by_seed"]) == 2
    assert row["seeds_reaching_target"] == 2  # target 9 nats: reached at the first evaluation
    assert row["steps_to_target_mean"] == 2
    report = compact((out / "results.md").read_text())
    assert "## dl" in report and "| test loss | train loss |" in report
    assert (out / "frontier.png").stat().st_size > 0


def test_tiny_table_runs():
    cfg = ft.load_table_config(ft.QUICK, [
        "seeds=2", "cosine_keys=2", "timing_steps=1", "datasets.0.steps=2",
        "datasets.0.eval_every=2", "datasets.0.train_eval_size=64"])
    (row,) = ft.run_table(cfg, ["digits"], ["BP-remat"])
    assert set(ft.ROW_KEYS) <= set(row) and row["dataset"] == "digits" and row["seeds"] == 2
    assert row["arm"] == "BP-remat" and row["lr"] == cfg.arms[1].lrs[0]
    assert row["cosine_mean"] == pytest.approx(1.0, abs=1e-5)  # exact gradients
    depth = cfg.datasets[0].model.depth  # and so in every segment: embed, blocks, head
    assert row["cosine_layers"] == pytest.approx([1.0] * (depth + 2), abs=1e-4)
    assert row["local_cosine_layers"] is None  # backprop follows no local loss
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
    text = compact((tmp_path / "r.md").read_text())
    assert "| BP |" in text and "machine: m" in text and "--from-json" in text
    # Two runs (e.g. one per data set) in one report, each with its own command and machine.
    src2 = tmp_path / "in2.json"
    src2.write_text(json.dumps([{**_row("BP", 0.7), "dataset": "t", "metric": "loss",
                                 "test_loss_mean": 2.5, "test_loss_sd": 0.01,
                                 "train_loss_mean": 2.4, "target_loss": 2.6}]))
    (tmp_path / "in2.json.meta").write_text(json.dumps({"command": "c2", "machine": "m2"}))
    got = ft.main(["--from-json", str(src), str(src2), "--docs", str(tmp_path / "r2.md")])
    assert [r["dataset"] for r in got] == ["d", "d", "t"]
    text = compact((tmp_path / "r2.md").read_text())
    assert "`c`" in text and "`c2`" in text and "machine: m2" in text and "## t" in text
    assert "| BP | 1e-03 | 2.500 ± 0.010 | 2.400 ± 0.000 |" in text


def _row(arm, err, sd=0.001, seeds=4):
    z = np.random.default_rng(sum(map(ord, arm))).standard_normal(seeds)  # the arm's own noise
    return {"dataset": "d", "arm": arm, "lr": 1e-3, "test_error_mean": err, "test_error_sd": sd,
            "train_error_mean": err, "seeds": seeds, "steps": 10, "peak_temp_bytes": 2**20,
            "step_ms": 1.0, "cosine_mean": 0.5, "target_accuracy": 0.9,
            "seeds_reaching_target": 0, "steps_to_target_mean": None, "seconds_to_target": None,
            "test_error_by_seed": list(err + sd * (z - z.mean()))}  # mean: err


def test_paired_verdicts_are_students_t_on_the_by_seed_differences():
    """t, df and p against scipy's own paired test, the interval against scipy's t interval;
    fewer than three paired seeds give no test, and the report says so (inconclusive) instead
    of calling a tie."""
    from scipy import stats

    from jaxstream_lab.table_verdicts import hybrid_verdict, paired

    a, b = _row("A", 0.030, sd=0.004, seeds=5), _row("B", 0.034, sd=0.004, seeds=5)
    got = paired(a, b)
    ref = stats.ttest_rel(a["test_error_by_seed"], b["test_error_by_seed"])
    assert got["df"] == 4 and got["n"] == 5
    np.testing.assert_allclose([got["t"], got["p"]], [ref.statistic, ref.pvalue], rtol=1e-10)
    d = np.subtract(a["test_error_by_seed"], b["test_error_by_seed"])
    np.testing.assert_allclose([got["lo"], got["hi"]],
                               stats.t.interval(0.95, 4, loc=d.mean(), scale=stats.sem(d)),
                               rtol=1e-10)
    few = [_row("exact-subset", 0.04, seeds=2), _row("FG-A", 0.05, seeds=2),
           _row("hybrid-x", 0.01, seeds=2)]
    line = hybrid_verdict(few, "d", _report())[1]
    assert "inconclusive against exact-subset (no test: 2 paired seeds, 3 needed)" in line
    assert line.endswith("→ inconclusive")
    # every seed 1 pp apart (a discrete test set): no spread, no t, no verdict; equal: p = 1
    shifted = {**b, "test_error_by_seed": [x + 0.01 for x in b["test_error_by_seed"]]}
    assert paired(shifted, b) == {"n": 5, "mean": pytest.approx(0.01), "constant": True}
    line = hybrid_verdict([{**b, "arm": "exact-subset"}, _row("FG-A", 0.05, seeds=5),
                           {**shifted, "arm": "hybrid-x"}], "d", _report())[1]
    assert ("inconclusive against exact-subset (no test: all 5 paired differences are "
            "+1.00 pp") in line and line.endswith("→ inconclusive")
    assert paired(b, b)["p"] == 1.0


def test_report_checks_follow_the_rows():
    from jaxstream_lab.table_report import markdown
    from jaxstream_lab.table_verdicts import hybrid_verdict, ordering

    def answers(rows):
        return [line.split(":")[1].split()[0] for line in ordering(rows, "d", _report())]

    spec = [("BP", 0.03), ("FG-W", 0.20), ("FG-A", 0.05), ("LG-FG-A", 0.031),
            ("exact-subset", 0.04), ("hybrid-a", 0.025), ("hybrid-b", 0.041)]
    # 4 seeds: LG-FG-A within 0.1 pp of BP, but no "≈" from fewer than 5 seeds
    assert answers([_row(a, e, seeds=4) for a, e in spec]) == ["yes", "yes", "inconclusive",
                                                                "yes"]
    rows = [_row(a, e, seeds=5) for a, e in spec]
    lines = ordering(rows, "d", _report())
    assert answers(rows) == ["yes", "yes", "yes", "yes"]
    assert "95 % CI [" in lines[2] and "Holm p = " in lines[2] and "TOST at ±0.5 pp" in lines[2]
    rows[2]["test_error_mean"] = 0.25  # FG-A now worse than FG-W
    rows[2]["test_error_by_seed"] = [x + 0.20 for x in rows[2]["test_error_by_seed"]]
    assert answers(rows)[0] == "no"
    verdict = hybrid_verdict(rows, "d", _report())
    assert "hybrid-a" in verdict[1] and verdict[1].endswith("BEATS BOTH")
    assert verdict[2].endswith("does not beat both")
    memory = {"rows": [{"depth": 8, "temp_bytes": {"backprop": 4, "backprop_remat": 1, "forward": 1,
                                                   "hybrid": 3, "inference": 1},
                        "step_ms": {"backprop": 2.0, "backprop_remat": 3.0, "forward": 2.0,
                                    "hybrid": 4.0, "inference": 1.0}}]}
    text = compact(markdown({"report": SECTION, "rows": rows, "command": "c", "machine": "m"}, None, memory))
    assert "| 8 |" in text and "0.250 | 1.50" in text and "Ren" in text
    assert "±0.5 pp of test error" in text  # the margin, stated once
    assert text.count("±0.5 pp of test error") == 1
    assert "Paired comparisons of this table (test error): 7 tests, Holm-adjusted" in text
    assert "Fewer than 5 seeds" not in text
    few = markdown({"report": SECTION, "rows": [_row(a, e, seeds=4) for a, e in spec], "command": "c"})
    assert "**Fewer than 5 seeds**: every row (7 arms) has 4 seeds" in few


def test_report_judges_loss_data_sets_by_test_loss():
    from jaxstream_lab.table_verdicts import hybrid_verdict, ordering

    def row(arm, loss, err):  # token errors ordered the other way, so a wrong key shows
        by_seed = [x - err + loss for x in _row(arm, err, seeds=5)["test_error_by_seed"]]
        return {**_row(arm, err, seeds=5), "metric": "loss", "test_loss_mean": loss, "test_loss_sd": 0.01,
                "test_loss_by_seed": by_seed}

    rows = [row("BP", 2.0, 0.9), row("FG-W", 3.5, 0.1), row("FG-A", 3.0, 0.2),
            row("LG-FG-A", 2.005, 0.3), row("exact-subset", 2.2, 0.4),
            row("hybrid-a", 2.1, 0.5)]
    lines = ordering(rows, "d", _report())
    assert [line.split(":")[1].split()[0] for line in lines] == ["yes", "yes", "yes", "yes"]
    assert "+0.500" in lines[0]  # FG-W - FG-A in nats
    rows[0]["test_loss_mean"] = 2.5  # BP no longer best, nor ≈ LG-FG-A
    rows[0]["test_loss_by_seed"] = [x + 0.5 for x in rows[0]["test_loss_by_seed"]]
    lines = ordering(rows, "d", _report())
    assert lines[2].split(":")[1].split()[0] == "no" and "(best LG-FG-A, worst FG-W;" in lines[3]
    verdict = hybrid_verdict(rows, "d", _report())
    assert "best forward arm LG-FG-A 2.005 ± 0.010" in verdict[0]
    assert "better than exact-subset (-0.100, 95 % CI [" in verdict[1] and "df = 4" in verdict[1]
    assert verdict[1].endswith("does not beat both")  # LG-FG-A (2.005) is better


def test_picks_at_the_edge_of_their_sweep_are_marked():
    """A rate picked at the edge of its sweep is marked (↑ largest, ↓ smallest) and counted:
    the best rate may lie outside what was tried."""
    from jaxstream_lab.table_report import lr_edge, markdown

    rows = [_row("BP", 0.03), _row("FG-W", 0.20), _row("FG-A", 0.05)]
    rows[0].update(lr=1e-2, lrs=[1e-3, 3e-3, 1e-2])   # largest tried
    rows[1].update(lr=1e-3, lrs=[1e-3, 3e-3])         # smallest tried
    rows[2].update(lr=3e-3, lrs=[1e-3, 3e-3, 1e-2])   # inside
    assert [lr_edge(r) for r in rows] == ["largest", "smallest", None]
    assert lr_edge({**rows[0], "lrs": [1e-2]}) == "only"  # one rate: at both edges
    text = compact(markdown({"report": SECTION, "rows": rows, "command": "c", "machine": "m"}))
    assert "| BP | 1e-02 ↑ |" in text and "| FG-W | 1e-03 ↓ |" in text and "| FG-A | 3e-03 |" in text
    assert "2 of 3 swept arms picked the edge of their sweep" in text and "BP, FG-W" in text


def test_a_killed_table_keeps_its_rows_and_resume_runs_only_the_rest(tmp_path, monkeypatch):
    """Rows are written as they finish; a run killed in its second row keeps the first
    (rows.json, report and plot); --resume runs only the missing row and keeps the first
    byte for byte."""
    from jaxstream.experiment.runner import run_experiment
    from jaxstream_lab import forward_table as lib

    over = ["seeds=1", "cosine_keys=1", "timing_steps=1",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 8, depth: 1}, "
            "steps: 2, batch_size: 8, eval_every: 2, train_eval_size: 32}]"),
            "report={}", ("arms=[{name: BP, estimator: {type: backprop}, lrs: [0.01]}, "
            "{name: FG-W, estimator: {type: forward, num_tangents: 2}, lrs: [0.001]}]")]
    real, calls = lib.run_arm, []

    def killed_in_second_row(cfg, dcfg, arm, *a, **k):
        calls.append(arm.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process is stopped in the second row
        return real(cfg, dcfg, arm, *a, **k)

    monkeypatch.setattr(lib, "run_arm", killed_in_second_row)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run_experiment(ft.QUICK, over, out=out)
    *base, first = json.loads((out / "rows.json").read_text())
    assert [b["arm"] for b in base] == ["chance", "logistic regression"]
    assert first["arm"] == "BP" and "| BP |" in compact((out / "results.md").read_text())
    assert (out / "frontier.png").is_file()
    monkeypatch.setattr(lib, "run_arm", real)
    calls.clear()
    monkeypatch.setattr(lib, "run_arm", lambda cfg, dcfg, arm, *a, **k: (
        calls.append(arm.name), real(cfg, dcfg, arm, *a, **k))[1])
    _, summary = run_experiment(ft.QUICK, over, out=out, resume=True)
    rows = json.loads((out / "rows.json").read_text())
    assert calls == ["FG-W"] and summary["resumed_rows"] == 3
    assert [r["arm"] for r in rows] == ["chance", "logistic regression", "BP", "FG-W"]
    assert rows[:3] == [*base, first]


def test_a_pick_at_the_edge_extends_the_sweep_and_every_rate_keeps_its_seeds():
    """Four Adam steps of backprop at 1e-4 and 3e-4, judged by the train loss: the larger rate
    wins, so the sweep grows by the sweep's own ratio (×3) past it, twice (extend_sweeps=2),
    and the pick is still flagged at the edge; the rates tried before keep the figures they
    had without the extension, and every rate keeps its per-seed finals."""
    over = ["seeds=2", "cosine_keys=1", "timing_steps=1", "baselines=false", "extend_sweeps=2",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 8, depth: 1}, "
            "steps: 4, batch_size: 8, eval_every: 2, train_eval_size: 32, metric: loss, "
            "target_loss: 9.0}]"),
            "report={}", "arms=[{name: BP, estimator: {type: backprop}, lrs: [0.0003, 0.0001]}]"]
    (grown,) = ft.run_table(ft.load_table_config(ft.QUICK, over))
    (plain,) = ft.run_table(ft.load_table_config(ft.QUICK, over + ["extend_sweeps=0"]))
    assert plain["lrs"] == [1e-4, 3e-4] and plain["lr"] == 3e-4 and plain["lr_at_edge"]
    assert plain["lrs_added"] == []
    assert grown["lrs_added"] == [9e-4, 2.7e-3] and grown["lrs"] == [1e-4, 3e-4, 9e-4, 2.7e-3]
    assert grown["lr"] == 2.7e-3 and grown["lr_at_edge"]
    by = np.asarray(grown["test_error_by_lr_seed"])
    assert by.shape == (4, 2) and np.asarray(grown["train_loss_by_lr_seed"]).shape == (4, 2)
    np.testing.assert_allclose(np.asarray(grown["train_loss_by_lr_seed"])[:2],
                               plain["train_loss_by_lr_seed"], rtol=1e-5)
    np.testing.assert_allclose(by[-1], grown["test_error_by_seed"])  # the pick's own seeds
    from jaxstream_lab.table_report import markdown

    text = markdown({"report": SECTION, "rows": [grown], "command": "c", "machine": "m"})
    assert "BP (+9e-04, 3e-03)" in text and "1 of 1 swept arms picked the edge" in text
    # one rate: both neighbours at once
    one = over[:-1] + ["report={}", "arms=[{name: BP, estimator: {type: backprop}, lrs: [0.0003]}]",
                       "extend_sweeps=1"]
    (single,) = ft.run_table(ft.load_table_config(ft.QUICK, one))
    assert single["lrs"] == [1e-4, 3e-4, 9e-4] and single["lrs_added"] == [1e-4, 9e-4]
    np.testing.assert_allclose(single["train_loss_by_lr_seed"][1],
                               plain["train_loss_by_lr_seed"][1], rtol=1e-5)


def test_extension_and_pick_rules():
    """One geometric step of the sweep past the edge; a diverged rate (NaN) is never picked,
    so a pick next to it lies inside the sweep."""
    from jaxstream_lab.forward_table import extension, pick_lr

    assert extension((1e-3, 3e-3, 1e-2), "largest") == pytest.approx(10 ** -1.5, rel=1e-2)
    assert extension((1e-3, 1e-2), "smallest") == pytest.approx(1e-4)
    assert extension((1e-3,), "largest") == pytest.approx(3e-3)  # one rate: ×3 either way
    final = np.zeros((3, 2, 4))
    final[:, :, 3] = [[0.5, 0.5], [0.2, 0.3], [np.nan, np.nan]]  # train loss per lr, seed
    final[:, :, 1] = [[0.1, 0.1], [0.0, 0.0], [np.nan, np.nan]]  # train error
    assert pick_lr(final, "error") == 1
    final[2, :, 3] = [0.1, 0.1]
    final[2, :, 1] = [0.0, 0.0]
    assert pick_lr(final, "error") == 2


def test_baselines_match_hand_counts():
    """Chance, and the unigram / bigram tables, against plain Python counts of the same data;
    logistic regression beats chance on digits and is no better on test than on train."""
    from jaxstream.data.digits import Dataset
    from jaxstream_lab.table_baselines import baselines

    rng = np.random.default_rng(0)
    v = 5
    tr = rng.integers(0, v, (6, 9))
    te = rng.integers(0, v, (3, 9))
    ds = Dataset({"x": tr[:, :-1], "y": tr[:, 1:]}, {"x": te[:, :-1], "y": te[:, 1:]},
                 {"vocab_size": v})
    uni, bi = baselines("t", ds, "loss")
    pairs = list(zip(tr[:, :-1].ravel().tolist(), tr[:, 1:].ravel().tolist()))
    test = list(zip(te[:, :-1].ravel().tolist(), te[:, 1:].ravel().tolist()))
    n_next = {b: sum(1 for _, y in pairs if y == b) for b in range(v)}
    p_uni = {b: (n_next[b] + 1) / (len(pairs) + v) for b in range(v)}
    p_bi = {(a, b): (sum(1 for p in pairs if p == (a, b)) + 1)
            / (sum(1 for x, _ in pairs if x == a) + v) for a in range(v) for b in range(v)}
    assert uni["test_loss_mean"] == pytest.approx(-np.mean([np.log(p_uni[b]) for _, b in test]))
    assert bi["test_loss_mean"] == pytest.approx(-np.mean([np.log(p_bi[p]) for p in test]))
    guess = {a: max(range(v), key=lambda b: (p_bi[(a, b)], -b)) for a in range(v)}
    assert bi["test_error_mean"] == pytest.approx(np.mean([guess[a] != b for a, b in test]))

    from jaxstream.data.digits import load_digits

    digits = load_digits(seed=0)
    chance, logreg = baselines("digits", digits, "error")
    y_tr, y_te = digits.train["y"], digits.test["y"]
    top = max(range(10), key=lambda c: (list(y_tr).count(c), -c))
    assert chance["test_error_mean"] == pytest.approx(np.mean(y_te != top))
    assert chance["test_loss_mean"] == pytest.approx(np.log(10))
    assert logreg["test_error_mean"] < 0.2 < chance["test_error_mean"]
    assert logreg["train_error_mean"] <= logreg["test_error_mean"]


def test_a_report_shows_baselines_beside_the_arms(tmp_path):
    from jaxstream_lab.table_plots import frontier_plot
    from jaxstream_lab.table_report import markdown

    base = {"dataset": "d", "kind": "baseline", "metric": "error", "train_error_mean": 0.02,
            "test_loss_mean": 0.2, "train_loss_mean": 0.1, "how": "h"}
    rows = [{**base, "arm": "logistic regression", "test_error_mean": 0.04},
            {**base, "arm": "chance", "test_error_mean": 0.9}, _row("BP", 0.03),
            *({**base, "dataset": "t", "metric": "loss", "arm": a, "test_error_mean": 0.7,
               "test_loss_mean": 2.5} for a in ("unigram", "bigram"))]  # 4 baselines in all
    text = compact(markdown({"report": SECTION, "rows": rows, "command": "c", "machine": "m"}))
    assert "| logistic regression | 4.00 | 2.00 | 0.200 | h |" in text
    assert "| chance | 90.00 |" in text and "| BP |" in text
    frontier_plot(rows, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 0


def test_ren_arms_train_their_own_heads_and_get_ren_figures():
    """An arm with ``local_heads`` trains the model with a head per block (the row says so);
    Ren et al.'s LG figures sit beside it, not beside the shared-head arm of the same
    estimator; a local_heads arm without local losses is refused by name."""
    from jaxstream_lab.table_report import markdown

    over = ["seeds=1", "cosine_keys=1", "timing_steps=1", "baselines=false",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 8, depth: 2}, "
            "steps: 2, batch_size: 8, eval_every: 2, train_eval_size: 32}]"),
            "report={}", ("arms=[{name: LG-FG-A, estimator: {type: forward, perturb: activations, "
            "local_losses: true}, lrs: [0.001]}, {name: LG-FG-A-Ren, estimator: {type: forward, "
            "perturb: activations, local_losses: true}, local_heads: true, lrs: [0.001]}]")]
    shared, own = ft.run_table(ft.load_table_config(ft.QUICK, over))
    assert (shared["local_heads"], own["local_heads"]) == ("shared", "own")
    # per segment (embed, 2 blocks, head): with the shared head the last block's and the
    # head's local losses are the global loss, so their two cosines agree; not the others'
    glob, loc = shared["cosine_layers"], shared["local_cosine_layers"]
    assert len(glob) == len(loc) == 4 and loc[2:] == pytest.approx(glob[2:], abs=1e-4)
    assert abs(loc[0] - glob[0]) > 1e-3
    assert own["local_cosine_layers"][2] != pytest.approx(own["cosine_layers"][2], abs=1e-3)
    assert own["test_error_by_seed"] != shared["test_error_by_seed"]
    text = compact(markdown({"report": SECTION, "rows": [shared, own], "command": "c", "machine": "m"}))
    assert "| arm | embed | block 0 | block 1 | head |" in text
    assert f"| {glob[0]:+.3f} ({loc[0]:+.3f}) |" in text
    line = lambda arm: next(x for x in text.splitlines() if x.startswith(f"| {arm} |"))
    assert line("LG-FG-A").endswith("| — | — |")
    assert line("LG-FG-A-Ren").endswith("| 3.24 | — |")  # one group: S/1/1 only
    sixteen = {**own, "arm": "LG-FG-A-Ren-G16", "local_groups": 16}
    text = compact(markdown({"report": SECTION, "rows": [shared, own, sixteen], "command": "c", "machine": "m"}))
    assert line("LG-FG-A-Ren-G16").endswith("| — | 2.55 |")  # 16 groups: M/1/16 only
    mixer = {**own, "model": "mixer"}  # their figures are of MLPs: none beside a Mixer
    cells = {**own, "arm": "cells", "model": "local_mixer", "local_groups": 4,
             "local_patch_groups": 16, "local_aggregate": True}
    text = compact(markdown({"report": SECTION, "rows": [shared, mixer, cells], "command": "c", "machine": "m"}))
    assert line("LG-FG-A-Ren").endswith("| — | — |")
    assert ("Local losses of the arms with heads of their own: LG-FG-A-Ren: a head of its own per block; cells: "
            "16 patch groups × 4 channel groups (64 cells per block), Ren et al.'s feature "
            "aggregator") in text
    with pytest.raises(ValueError, match=r"arms\.0\.local_heads: only local losses read local heads"):
        ft.load_table_config(ft.QUICK, ["report={}", ("arms=[{name: BP, estimator: {type: backprop}, "
                                        "local_heads: true}]")])


def test_a_step_counts_its_cost_in_forward_passes(tmp_path):
    """Backprop's step on an MLP 64 → 8 → 8 → 10, batch 8, costs its forward pass, the weight
    cotangents of every layer and the input cotangents of all but the first (hand count); K
    tangents cost more than one; the cost plot draws the counted rows."""
    from jaxstream_lab.table_plots import equivalents_plot

    over = ["seeds=1", "cosine_keys=1", "timing_steps=1", "baselines=false",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 8, depth: 1}, "
            "steps: 4, batch_size: 8, eval_every: 2, train_eval_size: 32}]"),
            "report={}", ("arms=[{name: BP, estimator: {type: backprop}, lrs: [0.01]}, "
            "{name: FG-W, estimator: {type: forward, num_tangents: 1}, lrs: [0.001]}, "
            "{name: FG-W-K4, estimator: {type: forward, num_tangents: 4}, lrs: [0.001]}]")]
    bp, k1, k4 = ft.run_table(ft.load_table_config(ft.QUICK, over))
    layers = [(64, 8), (8, 8), (8, 10)]
    forward = sum(2 * 8 * a * b for a, b in layers)
    backward = forward + sum(2 * 8 * a * b for a, b in layers[1:])
    assert bp["flops_per_step"] == forward + backward
    assert bp["forward_equivalents_per_step"] == pytest.approx((forward + backward) / forward)
    assert (bp["tangents"], k1["tangents"], k4["tangents"]) == (0, 1, 4)
    assert k4["forward_equivalents_per_step"] > k1["forward_equivalents_per_step"] > 1.0
    assert equivalents_plot([bp, k1, k4], str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 0
    assert not equivalents_plot([{**bp, "forward_equivalents_per_step": None}],
                                str(tmp_path / "none.png"))


def test_a_grouped_ren_arm_runs_and_what_it_cannot_be_is_refused():
    """An arm with ``local_groups`` trains the data set's model with a head per block and per
    feature group (the row says how many); groups need own heads and activity perturbation."""
    over = ["seeds=1", "cosine_keys=2", "timing_steps=1", "baselines=false", "extend_sweeps=0",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 8, depth: 2}, "
            "steps: 2, batch_size: 8, eval_every: 2, train_eval_size: 32}]"),
            "report={}", ("arms=[{name: LG-FG-A-Ren-G4, estimator: {type: forward, perturb: activations, "
            "local_losses: true}, local_heads: true, local_groups: 4, lrs: [0.001]}]")]
    (row,) = ft.run_table(ft.load_table_config(ft.QUICK, over))
    assert (row["local_heads"], row["local_groups"]) == ("own", 4)
    assert -1.0 <= row["cosine_mean"] <= 1.0 and np.isfinite(row["test_loss_mean"])
    with pytest.raises(ValueError, match=r"arms\.0\.local_groups: 4 groups need local heads"):
        ft.load_table_config(ft.QUICK, [over[-1].replace("local_heads: true", "local_heads: false")])
    with pytest.raises(ValueError, match=r"arms\.0\.local_groups: grouped local losses need "
                                         r"activity perturbation"):
        ft.load_table_config(ft.QUICK, ["report={}", ("arms=[{name: W, estimator: {type: local_forward_weights}"
                                        ", local_heads: true, local_groups: 4}]")])


def test_a_local_mixer_arm_with_aggregated_cells_runs_and_its_misuse_is_refused():
    """A LocalMixer data set with an arm of 4 patch groups × 2 channel groups under Ren et al.'s
    feature aggregator trains, its row names the design; the local target it follows is
    measured (cosines in [-1, 1]); a cell setting that cannot hold is refused by field."""
    mixer = ("datasets=[{name: d, data: {type: digits}, model: {type: local_mixer, patch: 2, "
             "width: 8, hidden: 8, depth: 2, groups: 2}, steps: 2, batch_size: 8, eval_every: 2, "
             "train_eval_size: 32}]")
    arm = ("arms=[{name: cells, estimator: {type: forward, perturb: activations, "
           "local_losses: true}, local_heads: true, local_groups: 2, local_patch_groups: 4, "
           "local_aggregate: true, lrs: [0.001]}]")
    over = ["seeds=1", "cosine_keys=2", "timing_steps=1", "baselines=false", "extend_sweeps=0",
            mixer, "report={}", arm]
    (row,) = ft.run_table(ft.load_table_config(ft.QUICK, over))
    assert (row["model"], row["local_groups"], row["local_patch_groups"],
            row["local_aggregate"]) == ("local_mixer", 2, 4, True)
    assert all(-1.0 <= c <= 1.0 for c in row["local_cosine_layers"])
    assert np.isfinite(row["test_loss_mean"])
    with pytest.raises(ValueError, match=r"arms\.0\.local_aggregate: the feature aggregator "
                                         r"needs cells"):
        ft.load_table_config(ft.QUICK, [mixer, "report={}", ("arms=[{name: a, estimator: {type: forward, "
                                        "perturb: activations, local_losses: true}, "
                                        "local_heads: true, local_aggregate: true}]")])
    with pytest.raises(ValueError, match=r"arms\.0\.local_patch_groups: local_over: "
                                         r"positions already splits"):
        ft.load_table_config(ft.QUICK, [mixer, arm.replace("local_aggregate: true",
                                                           "local_over: positions")])
    with pytest.raises(ValueError, match=r"groups: 3 must divide width \(8\) and hidden"):
        ft.load_table_config(ft.QUICK, [mixer.replace("groups: 2", "groups: 3"), arm])


def test_an_arm_runs_only_on_the_data_sets_it_names():
    """``datasets`` on an arm: its rows exist for those data sets only; a name the table does
    not have is refused when the config loads."""
    ds = ("{name: %s, data: {type: digits}, model: {type: mlp, width: 8, depth: 1}, steps: 2, "
          "batch_size: 8, eval_every: 2, train_eval_size: 32}")
    over = ["seeds=1", "cosine_keys=1", "timing_steps=1", "baselines=false", "extend_sweeps=0",
            f"datasets=[{ds % 'a'}, {ds % 'b'}]",
            "report={}", "arms=[{name: BP, lrs: [0.01]}, {name: BP-b, lrs: [0.01], datasets: [b]}]"]
    rows = ft.run_table(ft.load_table_config(ft.QUICK, over))
    assert [(r["dataset"], r["arm"]) for r in rows] == [("a", "BP"), ("b", "BP"), ("b", "BP-b")]
    with pytest.raises(ValueError, match=r"arms\.1\.datasets\.0: 'c' is not a data set of the "
                                         r"table; allowed: \['a', 'b'\]"):
        ft.load_table_config(ft.QUICK, over[:-1] + [over[-1].replace("[b]", "[c]")])


def test_backprop_at_each_arms_compute_is_read_off_its_own_curve():
    """An arm costing half BP's forward passes per step is compared with BP after half its
    steps; one costing twice as much with BP's end, marked ≥; none without a BP curve."""
    from jaxstream_lab.table_report import equal_compute_table, markdown

    bp = {**_row("BP", 0.1), "steps": 40, "eval_every": 10, "forward_equivalents_per_step": 3.0,
          "curve_test_error_mean": [0.5, 0.3, 0.2, 0.1]}
    cheap = {**_row("hybrid-weighted", 0.25), "steps": 40, "forward_equivalents_per_step": 1.5}
    dear = {**_row("FG-W-K16", 0.4), "steps": 40, "forward_equivalents_per_step": 6.0}
    text = compact(equal_compute_table([bp, cheap, dear], "d", _report()))
    assert "| hybrid-weighted | 1.50 | 20 | 30.00 | 25.00 |" in text
    assert "| FG-W-K16 | 6.00 | ≥ 40 | 10.00 | 40.00 |" in text
    assert equal_compute_table([cheap, dear], "d", _report()) == ""
    assert "Backprop at each arm's compute" in markdown(
        {"report": SECTION, "rows": [bp, cheap], "command": "c", "machine": "m"})


def test_k_is_an_axis_of_the_report():
    """Arms NAME and NAME-K<k> are one estimator at several K: one line, a column per K."""
    from jaxstream_lab.table_report import k_table

    rows = [{**_row("FG-A", 0.3), "tangents": 1, "forward_equivalents_per_step": 3.3},
            {**_row("FG-A-K4", 0.2), "tangents": 4, "forward_equivalents_per_step": 5.4},
            {**_row("FG-W-K16", 0.1), "tangents": 16},
            {**_row("BP", 0.05), "tangents": 0}]
    text = compact(k_table(rows, "d"))
    assert text.splitlines()[0] == "| estimator | K = 1 | K = 4 |"
    assert "| FG-A | 30.00 ± 0.10 (3.3) | 20.00 ± 0.10 (5.4) |" in text
    assert "FG-W" not in text and "BP" not in text  # one K only / no tangents
    assert k_table(rows[2:], "d") == ""


def test_local_designs_are_judged_against_one_loss_per_block_in_pairs():
    """Each LG-FG-A-Ren-* arm of a data set is compared with LG-FG-A-Ren seed by seed, with t,
    df and p equal to SciPy's paired t-test; an arm of another family is left out."""
    from scipy import stats

    from jaxstream_lab.table_verdicts import design_verdicts

    def row(arm, errs):
        return {"dataset": "d", "arm": arm, "test_error_by_seed": errs,
                "test_error_mean": float(np.mean(errs)), "test_error_sd": float(np.std(errs, ddof=1))}

    base, cells = [0.20, 0.23, 0.19], [0.10, 0.12, 0.08]
    rows = [row("LG-FG-A-Ren", base), row("LG-FG-A-Ren-P16G4-agg", cells),
            row("LG-FG-A-Ren-G4", [0.21, 0.22, 0.20]), row("FG-A", [0.5, 0.5, 0.5])]
    lines = design_verdicts(rows, "d", _report())
    assert len(lines) == 2 and not any(x.startswith("FG-A") for x in lines)
    t, p = stats.ttest_rel(cells, base)
    p2 = stats.ttest_rel([0.21, 0.22, 0.20], base).pvalue  # Holm over the two: 2 p, then max
    assert lines[0].startswith("LG-FG-A-Ren-P16G4-agg: 10.00 ± 2.00 % — better than LG-FG-A-Ren")
    d = np.subtract(cells, base)
    lo, hi = stats.t.interval(0.95, 2, loc=d.mean(), scale=stats.sem(d))
    assert (f"95 % CI [{100 * lo:+.2f}, {100 * hi:+.2f}] pp; t = {t:.2f}, df = 2, "
            f"p = {p:.3f}, Holm p = {min(1, 2 * p):.3f} (of 2)") in lines[0]
    assert "3 paired seeds (fewer than 5: no ≈)" in lines[0]
    assert lines[1].split(" — ")[1].startswith("inconclusive against LG-FG-A-Ren")
    assert f"p = {p2:.3f}, Holm p = {max(min(1, 2 * p), p2):.3f} (of 2)" in lines[1]
    assert design_verdicts(rows[1:], "d", _report()) == []  # no base arm: nothing to judge against


def test_the_shared_head_is_judged_against_heads_of_their_own_in_the_tables_family():
    """LG-FG-A against LG-FG-A-Ren: the paired difference with SciPy's t interval and test,
    Holm over every comparison the data set's table makes (here 3 ordering + 1 head + 1
    design = 5); a row set without both arms has no such line; seeds below 5 are named."""
    from scipy import stats

    from jaxstream_lab.table_verdicts import comparisons, family_size, head_verdict, seeds_note
    from jaxstream_lab.verdicts import holm

    def row(arm, errs):
        return {"dataset": "d", "arm": arm, "test_error_by_seed": errs, "seeds": len(errs),
                "test_error_mean": float(np.mean(errs)), "test_error_sd": float(np.std(errs, ddof=1))}

    rows = [row("BP", [0.10, 0.11, 0.12, 0.10, 0.11]), row("FG-W", [0.50, 0.52, 0.49, 0.51, 0.50]),
            row("FG-A", [0.20, 0.22, 0.21, 0.19, 0.20]),
            row("LG-FG-A", [0.30, 0.33, 0.29, 0.31, 0.30]),
            row("LG-FG-A-Ren", [0.25, 0.26, 0.25, 0.27, 0.24]),
            row("LG-FG-A-Ren-G4", [0.20, 0.21, 0.26, 0.22, 0.25])]
    tests = comparisons(rows, "d", _report())
    assert family_size(rows, "d", _report()) == 5 and len(tests) == 5
    ps = [stats.ttest_rel(rows[[r["arm"] for r in rows].index(a)]["test_error_by_seed"],
                          rows[[r["arm"] for r in rows].index(b)]["test_error_by_seed"]).pvalue
          for a, b in tests]
    assert [t["p_holm"] for t in tests.values()] == pytest.approx(holm(ps), rel=1e-10)
    (line,) = head_verdict(rows, "d", _report())
    d = np.subtract(rows[3]["test_error_by_seed"], rows[4]["test_error_by_seed"])
    lo, hi = stats.t.interval(0.95, 4, loc=d.mean(), scale=stats.sem(d))
    assert line.startswith("LG-FG-A (shared head) 30.60 ± 1.52 % — worse than LG-FG-A-Ren")
    assert f"95 % CI [{100 * lo:+.2f}, {100 * hi:+.2f}] pp" in line and "(of 5)" in line
    assert "fewer than 5" not in line
    assert head_verdict(rows[:4], "d", _report()) == []
    assert seeds_note(rows, "d") == ""
    rows[5] = row("LG-FG-A-Ren-G4", [0.20, 0.21, 0.26])
    assert seeds_note(rows, "d").startswith("**Fewer than 5 seeds**: LG-FG-A-Ren-G4 (3) have")


def test_a_validation_split_is_a_seeded_share_of_the_training_set():
    """``validation: 0.2``: a fifth of the training rows held out, disjoint from the rest,
    together the whole training set; the same rows for the same seed, others for another;
    the test set untouched."""
    from jaxstream_lab.table_config import TableDataset
    from jaxstream_lab.table_data import table_data

    plain = TableDataset().data.dataset(0)
    held = table_data(TableDataset(validation=0.2), 0)
    n = len(plain.train["y"])
    assert len(held.validation["y"]) == round(0.2 * n)
    assert len(held.train["y"]) + len(held.validation["y"]) == n
    rows = lambda d: {r.tobytes() + bytes([int(y)]) for r, y in zip(d["x"], d["y"])}
    assert rows(held.train) | rows(held.validation) == rows(plain.train)
    assert not rows(held.train) & rows(held.validation)
    np.testing.assert_array_equal(held.test["x"], plain.test["x"])
    again, other = table_data(TableDataset(validation=0.2), 0), table_data(TableDataset(validation=0.2), 1)
    np.testing.assert_array_equal(again.validation["x"], held.validation["x"])
    assert rows(other.validation) != rows(held.validation)
    assert table_data(TableDataset(), 0).validation is None


def test_the_pick_reads_the_validation_columns_when_there_are_some():
    from jaxstream_lab.forward_table import pick_lr

    final = np.zeros((2, 3, 6))
    final[:, :, 1] = [[0.0] * 3, [0.1] * 3]  # train error: rate 0 lower
    final[:, :, 4] = [[0.3] * 3, [0.2] * 3]  # validation error: rate 1 lower
    assert pick_lr(final, "error") == 0 and pick_lr(final, "error", validation=True) == 1
    final[:, :, 4] = 0.2  # a tie on validation error: the validation loss breaks it
    final[:, :, 5] = [[0.7] * 3, [0.9] * 3]
    assert pick_lr(final, "error", validation=True) == 0


def test_a_table_with_a_validation_split_picks_on_it_and_says_so():
    over = ["seeds=2", "cosine_keys=1", "timing_steps=1", "baselines=false", "extend_sweeps=0",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 8, depth: 1}, "
             "steps: 4, batch_size: 8, eval_every: 2, train_eval_size: 32, validation: 0.25}]"),
            "report={}", "arms=[{name: BP, estimator: {type: backprop}, lrs: [0.0001, 0.001, 0.01]}]"]
    (row,) = ft.run_table(ft.load_table_config(ft.QUICK, over))
    assert row["picked_on"] == "validation"
    err = np.asarray(row["validation_error_by_lr_seed"])
    loss = np.asarray(row["validation_loss_by_lr_seed"])
    assert err.shape == loss.shape == (3, 2)
    # the pick, recomputed from the stored figures: lowest mean validation error, then loss
    want = min(range(3), key=lambda i: (err[i].mean(), loss[i].mean()))
    assert row["lr"] == row["lrs"][want]
    from jaxstream_lab.table_report import markdown

    text = markdown({"report": SECTION, "rows": [row], "command": "c", "machine": "m"})
    assert "lowest mean final validation error" in text
    (plain,) = ft.run_table(ft.load_table_config(ft.QUICK, over[:-3] + [
        over[-3].replace(", validation: 0.25", ""), *over[-2:]]))
    assert plain["picked_on"] == "train" and "validation_error_by_lr_seed" not in plain
    assert "validation error" not in markdown({"report": SECTION, "rows": [plain], "command": "c", "machine": "m"})
