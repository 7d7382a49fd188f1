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
                         timeout=60, check=False)
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


# Two processes of jax.distributed (one CPU device each): process 1 dies, or lives on slowly;
# process 0 watches its peers (2 s) and then waits at a barrier, or in jax.distributed's shutdown.
PAIR = """
import os, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
port, pid, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                           process_id=pid)
from jax._src import distributed
from jaxstream.compose.peers import watch_peers
watch_peers(2.0)
distributed.global_state.client.wait_at_barrier("both-watching", 60000)
time.sleep(1.5)  # each has heard the other
if pid == 1:
    if mode == "slow":  # alive, and late to the shutdown by twice the timeout
        time.sleep(4.0); jax.distributed.shutdown(); print("done"); sys.exit(0)
    os._exit(9)
if mode == "barrier":  # JAX's barrier would wait for the dead peer until its heartbeat timeout
    distributed.global_state.client.wait_at_barrier("never", 120000)
jax.distributed.shutdown()
print("done")
"""


def run_pair(mode: str) -> list[subprocess.CompletedProcess]:
    from tests.processes import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PAIR, port, str(i), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e)
            for p, (o, e) in zip(procs, outs)]


def test_a_dead_peer_ends_a_process_waiting_at_a_barrier_or_the_shutdown_in_one_line():
    """Before: the survivor waited in the barrier (or JAX's shutdown) until JAX's heartbeat
    timeout and was aborted with a C++ stack dump; the peer watch does not run there."""
    for mode in ("barrier", "shutdown"):
        out = run_pair(mode)[0]
        assert out.returncode == 2 and "done" not in out.stdout, (mode, out.stderr[-2000:])
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("jaxstream:")]
        assert len(lines) == 1 and out.stderr.strip().splitlines()[-1] == lines[0], out.stderr
        assert lines[0].startswith("jaxstream: process 0 of 2: process 1 gave no sign of life")
        assert "peer_timeout_s=2" in lines[0] and "Check failure" not in out.stderr


def test_a_slow_live_peer_is_not_taken_for_lost():
    for out in run_pair("slow"):
        assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]


def test_only_copies_one_step_ahead_of_the_commit_the_others_hold_roll_back():
    """Rows (step, fingerprint, previous step, previous fingerprint), one per process."""
    import numpy as np

    from jaxstream.compose.peers import ahead_by_one

    a, b, c, d = 0xA, 0xB, 0xC, 0xD
    none = 0xFFFFFFFF  # a copy that keeps no earlier commit
    rows = lambda *r: np.array(r, np.int64)
    assert ahead_by_one(rows([2, a, 1, b], [1, b, 0, c])) == [0]
    assert ahead_by_one(rows([1, b, 0, c], [2, a, 1, b], [2, a, 1, b])) == [1, 2]
    assert ahead_by_one(rows([1, b, 0, c], [1, b, 0, c])) is None  # they agree
    assert ahead_by_one(rows([2, a, 1, d], [1, b, 0, c])) is None  # ahead of another commit
    assert ahead_by_one(rows([3, a, 2, b], [1, b, 0, c])) is None  # two steps apart
    assert ahead_by_one(rows([2, a, 1, b], [1, b, 0, c], [1, d, 0, c])) is None  # behind differ
    assert ahead_by_one(rows([2, a, none, 0], [1, b, 0, c])) is None


# A coordination-service client whose calls take 0.5 s, then say so: the process exits while
# the watch's thread is inside one. A daemon thread still in such a call when the interpreter
# finalises is ended by a forced unwind (with jaxlib's client: an abort, status -6, after the
# run's work was done); the watch lets its call return and stops first.
EXITING = """
import sys, time
from jax._src import distributed
from jaxstream.compose import peers

class Client:
    def key_value_set(self, key, value, allow_overwrite=False):
        time.sleep(0.5); print("set returned", flush=True)
    def key_value_try_get(self, key):
        return None

distributed.global_state.client = Client()
distributed.global_state.process_id, distributed.global_state.num_processes = 0, 2
peers.watch_peers(30.0)
time.sleep(0.1)  # the watch is inside its first call
print("done", flush=True)
"""


def test_the_liveness_watch_leaves_no_call_behind_at_exit():
    out = subprocess.run([sys.executable, "-c", EXITING], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["done", "set", "returned"], out.stdout
