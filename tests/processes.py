"""Runs a worker script as 2 processes of ``jax.distributed`` on loopback (the multi-host tests)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two(worker: Path, *args: str, timeout: float = 400) -> None:
    """``python worker PORT PROCESS_ID *args`` for process ids 0 and 1; fails the test with
    both logs unless both exit 0."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(worker), port, str(i), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
