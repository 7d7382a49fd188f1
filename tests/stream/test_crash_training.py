"""Streamed training killed with SIGKILL resumes to the parameters of an uninterrupted run:
the forward estimator's lazy updates written back every 3 records (``rewrite_every=3``: kills
land in steps that write no block and in steps that rewrite them), and a hybrid's update deferred
to each layer's next read (its exact means in the store's carry slots)."""

from __future__ import annotations

import shutil

import pytest

from tests.stream import crash_harness
from tests.stream.crash_harness import run_crash_experiment


@pytest.mark.parametrize("update", ["lazy_k3", "hybrid_lazy"])
def test_killed_training_resumes_to_uninterrupted_params(tmp_path, update):
    _check(run_crash_experiment(kills=1, steps=6, seed=1, workdir=str(tmp_path), update=update))


@pytest.mark.slow
def test_killed_training_with_async_commits_resumes(tmp_path, monkeypatch):
    """Commits landing while the next step computes (``async_commit``): a kill at a random
    moment, and one inside a manifest write, open at a committed step and resume bitwise."""
    monkeypatch.setenv("CRASH_ASYNC_COMMIT", "1")
    monkeypatch.setattr(crash_harness, "ASYNC", True)
    _check(run_crash_experiment(kills=2, steps=6, seed=2, workdir=str(tmp_path),
                                update="hybrid_lazy", manifest_kills=1))


def _check(result: dict) -> None:
    shutil.rmtree(result["workdir"], ignore_errors=True)
    for trial in result["trials"]:
        assert trial["opened_at_committed_step"], result
        assert trial["resumed_equal"], result
        assert 2 <= trial["killed_at_step"] <= 6
