"""The pipeline over 2 processes x 2 CPU devices (jax.distributed on loopback)."""

from pathlib import Path

from tests.processes import run_two

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def test_two_processes_match_single_process(tmp_path):
    out = tmp_path / "err.txt"
    run_two(WORKER, str(out), timeout=240)
    err, loss_err = map(float, out.read_text().split())
    assert err <= 1e-5 and loss_err <= 1e-6
