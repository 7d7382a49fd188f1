"""Streamed training killed with SIGKILL resumes to the parameters of an uninterrupted run:
the forward estimator's lazy updates, and a hybrid's update deferred to each layer's next read
(its exact means in the store's carry slots)."""

from __future__ import annotations

import shutil

import pytest

from tests.stream.crash_harness import run_crash_experiment


@pytest.mark.parametrize("update", ["lazy", "hybrid_lazy"])
def test_killed_training_resumes_to_uninterrupted_params(tmp_path, update):
    result = run_crash_experiment(kills=1, steps=6, seed=1, workdir=str(tmp_path), update=update)
    shutil.rmtree(result["workdir"], ignore_errors=True)
    trial = result["trials"][0]
    assert trial["opened_at_committed_step"], result
    assert trial["resumed_equal"], result
    assert 2 <= trial["killed_at_step"] <= 6
