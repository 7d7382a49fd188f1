"""The composed engine over 2 processes × 4 CPU devices (jax.distributed on loopback) equals
one process."""

from pathlib import Path

from tests.processes import run_two

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def test_two_processes_match_one(tmp_path):
    run_two(WORKER, str(tmp_path))
    err, loss_err, moved = map(float, (tmp_path / "err.txt").read_text().split())
    assert err <= 1e-5 and loss_err <= 1e-5 and moved > 1e-3


def test_store_copies_at_different_commits_are_refused_on_every_process(tmp_path):
    """Each process streams from its own store copy: a copy that moved on alone is refused
    before any step, on both processes, naming each copy's step (after every commit the copies
    are checked again; the test above passes that check on every step)."""
    run_two(WORKER, str(tmp_path), "disagree")
    for pid in (0, 1):
        msg = (tmp_path / f"refused{pid}.txt").read_text()
        assert "copies disagree: process 0 at step 0" in msg and "process 1 at step 1" in msg
        assert f"this is process {pid}" in msg
