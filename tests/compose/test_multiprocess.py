"""The composed engine over 2 processes × 4 CPU devices (jax.distributed on loopback) equals
one process."""

from pathlib import Path

from tests.processes import run_two

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def test_two_processes_match_one(tmp_path):
    run_two(WORKER, str(tmp_path))
    err, loss_err, moved = map(float, (tmp_path / "err.txt").read_text().split())
    assert err <= 1e-5 and loss_err <= 1e-5 and moved > 1e-3
