"""The composed engine over 2 processes × 4 CPU devices (jax.distributed on loopback) equals
one process."""

import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=400)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    err, loss_err, moved = map(float, (tmp_path / "err.txt").read_text().split())
    assert err <= 1e-5 and loss_err <= 1e-5 and moved > 1e-3
