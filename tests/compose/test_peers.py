"""The peer watch: a step that makes no progress ends the process with one line and status 2;
a step that progresses, or no step at all, does not."""

from __future__ import annotations

import subprocess
import sys
import time

SCRIPT = """
import sys, time
from jaxstream.compose.peers import PeerWatch
w = PeerWatch(1.0)
mode = sys.argv[1]
if mode == "idle":          # no step running: never fires
    time.sleep(3); print("alive")
elif mode == "beating":     # progress every 0.3 s for 3 s, then the step ends
    w.begin()
    for _ in range(10):
        time.sleep(0.3); w.beat()
    w.end(); time.sleep(2); print("alive")
else:                       # a step that stalls
    w.begin(); time.sleep(30); print("not reached")
"""


def run(mode: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=60)
    return out, time.monotonic() - t0


def test_a_stalled_step_ends_the_process_in_one_line():
    out, took = run("stalled")
    assert out.returncode == 2 and "not reached" not in out.stdout
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("jaxstream: process 0 of 1: the composed step made no progress")
    assert "peer_timeout_s=1" in line and took < 20


def test_progress_and_idle_time_do_not_end_it():
    for mode in ("idle", "beating"):
        out, _ = run(mode)
        assert out.returncode == 0 and out.stdout.strip() == "alive", out.stderr
