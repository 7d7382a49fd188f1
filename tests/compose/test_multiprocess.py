"""The composed engine over 2 processes × 4 CPU devices (jax.distributed on loopback) equals
one process."""

from pathlib import Path

from tests.processes import run_two

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def test_two_processes_match_one_even_35_s_apart(tmp_path):
    """Two Adam steps of a hybrid over 2 processes equal one process. Process 1 reaches its
    first program 35 s after process 0, past Gloo's fixed 30 s deadline for a collective
    (before: process 0 failed with DEADLINE_EXCEEDED and process 1 aborted): each program is
    compiled ahead and the processes meet at a coordination-service barrier before its first
    run."""
    run_two(WORKER, str(tmp_path), "late35")
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


def test_a_lost_peer_ends_the_survivor_in_one_line_and_bounded_time(tmp_path):
    """Process 1 dies (as by SIGKILL) after the first step; process 0's second step fails in a
    collective, and the process ends at once with exit status 2 and one line that says so
    (not after the coordination service's 100 s heartbeat timeout with an abort), its store
    at the last commit (step 1). Restarting both processes resumes from that commit."""
    import subprocess
    import sys
    import time

    from tests.processes import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), port, str(i), str(tmp_path), "lost"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ended = time.time()
    assert procs[1].returncode == 9, outs[1][1][-2000:]
    assert procs[0].returncode == 2, outs[0][1][-3000:]
    last = outs[0][1].strip().splitlines()[-1]
    assert last.startswith("jaxstream: process 0 of 2: a collective of the composed step "
                           "failed") and "a peer process is lost" in last, last
    assert "restart every process" in last
    waited = ended - float((tmp_path / "lost_at.txt").read_text())
    assert waited < 30, waited  # the failed collective and the exit; not the 100 s heartbeat
    from jaxstream.stream import LayerStore

    assert LayerStore.open(tmp_path / "store0").step == 1
    assert LayerStore.open(tmp_path / "store1").step == 1
    # Restarting both processes resumes from the step every copy committed: the one step left
    # brings both copies to the uninterrupted two-step run of one process.
    run_two(WORKER, str(tmp_path), "resume")
    err, loss_err, moved = map(float, (tmp_path / "err.txt").read_text().split())
    assert err <= 1e-5 and loss_err <= 1e-5 and moved > 1e-3
