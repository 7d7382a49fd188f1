"""The equal-budget table: bias and variance of an estimate split as their float64 formulas
say; backprop's gradient accumulation matched to a forward arm's compiled memory; families
grouped by their estimator config, never by arm name; per-K verdicts with Holm."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import forward_table as ft

from jaxstream_lab import budget_report
from jaxstream_lab.table_probe import bias_variance

BUDGET = ROOT / "experiments" / "budget_table.yaml"


def test_bias_and_variance_split_the_mean_squared_error():
    rng = np.random.default_rng(0)
    g = rng.normal(size=50)
    bias = 0.3 * rng.normal(size=50)
    est = g + bias + rng.normal(size=(8, 50))
    b2, var = bias_variance(est.astype(np.float32), g)
    # float64 by hand: the sample variance, and the mean estimate's error less its noise
    mean = est.mean(axis=0)
    want_var = sum(float((e - mean) @ (e - mean)) for e in est) / 7
    assert var == pytest.approx(want_var / (g @ g), rel=1e-5)
    assert b2 == pytest.approx((float((mean - g) @ (mean - g)) - want_var / 8) / (g @ g),
                               rel=1e-5)
    # the mean squared error over the draws is bias² + variance exactly
    mse = np.mean([((e - g) @ (e - g)) for e in est]) / (g @ g)
    assert b2 + var == pytest.approx(mse, rel=1e-5)
    # unbiased for an unbiased estimator: bias² averages to 0 over many draws (4 standard errors)
    draws = [bias_variance(g + rng.normal(size=(4, 50)), g)[0] for _ in range(2000)]
    assert abs(np.mean(draws)) < 4 * np.std(draws) / np.sqrt(len(draws))


def _row(arm, family, k, errors, **more):
    return {"dataset": "d", "arm": arm, "family": family, "directions": k, "seeds": len(errors),
            "test_error_by_seed": errors, "test_error_mean": float(np.mean(errors)),
            "test_error_sd": float(np.std(errors, ddof=1)), "lr": 1e-3, **more}


def _synthetic() -> list[dict]:
    """Rows written here by hand: at K = 1 activations beat weights and SPSA on every seed, at
    K = 4 weights and activations differ by noise; one exact arm at a matched memory."""
    base = np.array([0.10, 0.12, 0.09, 0.11, 0.10])
    jitter = np.array([0.001, -0.002, 0.002, 0.0, -0.001])
    rows = [_row("w1", "jvp weights", 1, list(base + 0.20 + jitter)),
            _row("a1", "jvp activations", 1, list(base)),
            _row("s1", "SPSA", 1, list(base + 0.25 - jitter)),
            _row("w4", "jvp weights", 4, list(base + 0.01 * np.array([1, -1, 2, -2, 0]))),
            _row("a4", "jvp activations", 4, list(base)),
            _row("bp", "exact", 0, list(base - 0.05 + jitter), memory_target_arm="s1",
                 memory_target_bytes=2048, memory_matched=True, accumulate=2,
                 peak_temp_bytes=1024, temp_bytes_by_accumulate={"1": 4096, "2": 1024}),
            _row("name-says-SPSA", "exact", 0, list(base))]  # no memory match: not compared
    return rows


def test_the_report_names_a_winner_only_where_the_tests_say_so():
    rows = _synthetic()
    assert list(budget_report.budgets(rows, "d")) == [1, 4]
    tests = budget_report.comparisons(rows, "d")
    assert len(tests[1]) == 3 + 1 and len(tests[4]) == 1 + 1  # pairs + best vs matched exact
    win = budget_report.winners(rows, "d")
    assert win[0].startswith("K = 1: lowest mean jvp activations (a1") and "**wins**" in win[0]
    assert "no single winner" in win[1] and "jvp weights" in win[1]
    text = budget_report.markdown(rows, "d")
    assert "| K " in text and "2 chunks of the batch" in text and "K = 1: 4, K = 4: 2" in text
    assert "better than every other family at this K, after Holm: jvp weights (w1); SPSA (s1)" in text
    assert "a1 (jvp activations) worse than bp (exact)" in text


def test_the_budget_document_and_plot_are_written_from_rows(tmp_path):
    from jaxstream_lab.budget_doc import document

    rows = [{**r, "steps": 10, "forward_equivalents_per_step": 2.0 + r["directions"],
             "lrs": [1e-3], "picked_on": "validation"}
            for r in _synthetic()]
    png = tmp_path / "b.png"
    assert budget_report.plot(rows, str(png)) and png.stat().st_size > 1000
    text = document({"rows": rows, "command": "c", "machine": "m", "seconds": 1.0}, str(png))
    assert text.startswith("# Forward-mode against zeroth-order") and "![budget](b.png)" in text
    # cells as formatted (3.00 forward passes, rate 1e-03), not re-parsed as numbers by tabulate
    assert "| 3.00 " in text and "| 1e-03 " in text
    assert "## d" in text and "rates picked on the validation split" in text
    assert "the paired comparisons of one K (the family" in text
    one_family = [r for r in rows if r["family"] in ("exact", "SPSA")]
    assert not budget_report.plot(one_family, str(tmp_path / "none.png"))


def test_the_budget_table_parses_and_names_its_families_from_estimators():
    cfg = ft.load_table_config(BUDGET)
    fams = {a.name: budget_report.family(a.estimator) for a in cfg.arms}
    assert {f for f, _ in fams.values()} == {"exact", "jvp weights", "jvp activations",
                                             "jvp weights, rank 1", "SPSA", "SPSA, rank 1"}
    assert {k for _, k in fams.values()} == {0, 1, 4, 16} and cfg.seeds >= 5
    # local losses, hybrids and the exact subset are no family of this comparison
    main = ft.load_table_config(ft.FULL)
    others = {a.name: budget_report.family(a.estimator)[0] for a in main.arms}
    assert {n for n, f in others.items() if f is None} >= {"LG-FG-A", "local-guess",
                                                            "exact-subset", "hybrid-weighted"}
    assert others["FG-A-K4"] == "jvp activations" and others["BP-remat"] == "exact"
    with pytest.raises(ValueError, match=r"arms\.2\.match_memory_of: 'nope' is not another arm"):
        ft.load_table_config(BUDGET, ["arms.2.match_memory_of=nope"])
    with pytest.raises(ValueError, match=r"match_memory_of: memory is matched by gradient acc"):
        ft.load_table_config(BUDGET, ["arms.0.match_memory_of=SPSA"])


def test_accumulation_matches_a_forward_arms_memory_and_rows_carry_bias_and_variance():
    """A tiny table where rematerialised backprop needs more memory than SPSA: the matched arm
    takes the fewest chunks whose step fits (its own probe's memory at most SPSA's, measured by
    SPSA's own row), and every row has its estimate's bias² and variance at init and mid."""
    over = ["seeds=2", "cosine_keys=4", "timing_steps=1", "baselines=false", "extend_sweeps=0",
            "mid_probe_lr=0.01",
            ("datasets=[{name: d, data: {type: digits}, model: {type: mlp, width: 100, depth: 1},"
             " steps: 4, batch_size: 128, eval_every: 2, train_eval_size: 32}]"),
            ("arms=[{name: acc, estimator: {type: backprop, remat: true}, match_memory_of: S, "
             "lrs: [0.01]}, {name: S, estimator: {type: spsa, num_directions: 2}, lrs: [0.001]},"
             " {name: W, estimator: {type: forward, num_tangents: 2}, lrs: [0.001]}]")]
    acc, spsa, fw = ft.run_table(ft.load_table_config(BUDGET, over))
    assert spsa["peak_temp_bytes"] == acc["memory_target_bytes"]
    assert acc["accumulate"] > 1 and acc["memory_matched"]
    assert acc["peak_temp_bytes"] <= spsa["peak_temp_bytes"]
    temps = {int(c): b for c, b in acc["temp_bytes_by_accumulate"].items()}
    assert all(temps[c] > spsa["peak_temp_bytes"] for c in temps if c < acc["accumulate"])
    assert acc["estimator"] == f"backprop(remat, accumulate {acc['accumulate']})"
    assert acc["cosine_mean"] == pytest.approx(1.0, abs=1e-5)  # still the exact gradient
    assert abs(acc["bias_sq_rel"]) < 1e-8 and acc["variance_rel"] < 1e-8
    for r in (spsa, fw):
        assert r["variance_rel"] > 1.0 and r["mid_variance_rel"] > 1.0  # K = 2 directions
        # the keys' mean squared error is bias² + variance exactly (float32 sums: 1e-4)
        assert r["relative_mse"] == pytest.approx(r["bias_sq_rel"] + r["variance_rel"],
                                                  rel=1e-4)
        assert r["mid_step"] == 2 and r["directions"] == 2
    assert (spsa["family"], fw["family"]) == ("SPSA", "jvp weights")
    assert acc["uniform_loss"] == pytest.approx(np.log(10))  # digits: the stability bar
