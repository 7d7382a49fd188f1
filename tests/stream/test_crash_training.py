"""Streamed training killed with SIGKILL resumes to the parameters of an uninterrupted run."""

from __future__ import annotations

import shutil

from tests.stream.crash_harness import run_crash_experiment


def test_killed_training_resumes_to_uninterrupted_params(tmp_path):
    result = run_crash_experiment(kills=1, steps=6, seed=1, workdir=str(tmp_path))
    shutil.rmtree(result["workdir"], ignore_errors=True)
    trial = result["trials"][0]
    assert trial["opened_at_committed_step"], result
    assert trial["resumed_equal"], result
    assert 2 <= trial["killed_at_step"] <= 6
