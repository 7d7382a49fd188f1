"""The pipeline-schedules notebook: committed with its outputs, runs top to bottom, and every
result its text states holds for the numbers it prints."""

from __future__ import annotations

from typing import Any

import pytest

from tests import notebook_claims as nbc

NOTEBOOK = nbc.ROOT / "notebooks" / "02_pipeline_schedules.ipynb"
IND, COR = "independent micro-batches", "correlated micro-batches"
DEL = "delayed (stale 1 step)"
POLICIES = ("truncated", DEL, "complete")
#: The executor and the single-device estimator sum in other orders (float32).
EXECUTOR_RTOL = 1e-5


def check_claims(c: dict[str, Any]) -> None:
    """Each sentence of the notebook's "Reading the results", against its numbers."""
    t = c["table"]
    m, n = t["M"], t["N"]
    rows = {(r["policy"], r["k"]): r for r in t["rows"]}
    ks = sorted({r["k"] for r in t["rows"]})
    # Forward-only GPipe wastes (M-1)/(N+M-1) of the stage-ticks.
    assert abs(t["idle_fraction"] - (m - 1) / (n + m - 1)) < 1e-12
    # truncated and delayed add no tick; complete adds k, fewer than a backprop pipeline.
    for k in ks:
        assert rows["truncated", k]["added_ticks"] == 0 == rows[DEL, k]["added_ticks"]
        assert rows["complete", k]["added_ticks"] == k < t["backprop_added_ticks"]
        # delayed fills a larger share of the bubble than truncated ...
        assert rows[DEL, k]["fill_ratio"] > rows["truncated", k]["fill_ratio"]
        # complete: exact gradients on every stage of the k selected micro-batches.
        assert abs(rows["complete", k]["coverage"] - k / n) < 1e-12
    # ... growing with k.
    fills = [rows[DEL, k]["fill_ratio"] for k in ks]
    assert fills == sorted(fills) and fills[0] < fills[-1]
    # The executor equals the single-device estimator.
    assert c["executor_rel_err"] <= EXECUTOR_RTOL
    # truncated covers only the upper stages (first exact block 2 or higher) ...
    first = c["first_exact_block"]
    assert min(first["truncated"]) >= 2 and first["complete"] == [0] * len(first["complete"])
    per = c["blocks_per_stage"]
    uncovered = range(min(first["truncated"]) // per)
    assert len(uncovered) >= 1
    # ... yet with correlated micro-batches raises every stage's cosine, uncovered ones too;
    # so does every policy.
    for p in POLICIES:
        g = c["gain"][f"{COR} / {p}"]
        for s, (mean, se) in enumerate(zip(g["mean"], g["se"])):
            assert nbc.exceeds(mean, se), f"correlated, {p}, stage {s}: gain {mean} +- {se}"
    # Independent micro-batches: every policy gains less than with correlated ones.
    for p in POLICIES:
        d = c["correlated minus independent gain"][p]
        assert nbc.exceeds(d["stage_mean"], d["stage_mean_se"]), (p, d)
    # Correlated, averaged over the stages: complete > delayed > truncated.
    for a, b in (("complete", DEL), (DEL, "truncated")):
        d = c["order"][f"{COR} / {a} - {b}"]
        assert nbc.exceeds(d["stage_mean"], d["stage_mean_se"]), (a, b, d)


def test_committed_with_outputs_whose_claims_hold():
    nb = nbc.committed(NOTEBOOK)
    assert nbc.unexecuted(nb) == []
    assert nbc.images(nb) >= 2
    check_claims(nbc.claims(nb))


@pytest.mark.slow  # executes the notebook: about a minute on 2 CPU cores
def test_pipeline_notebook_runs_and_its_claims_hold(monkeypatch):
    nb = nbc.execute(NOTEBOOK, monkeypatch,
                 env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    out = nbc.text(nb)
    assert "max rel err vs single device" in out and "cosine per stage" in out
    assert nbc.images(nb) >= 2
    check_claims(nbc.claims(nb))
