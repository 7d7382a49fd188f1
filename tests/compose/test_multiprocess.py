"""The composed engine over 2 processes × 4 CPU devices (jax.distributed on loopback) equals
one process."""

from pathlib import Path

import pytest

from tests.compose.kills import Kill, kill_once
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
    """Each process streams from its own store copy: a copy that moved on alone by two steps
    is refused before any step, on both processes, naming each copy's step (after every commit
    the copies are checked again; the test above passes that check on every step). A copy one
    step ahead of a commit the others hold is rolled back instead (the kill test below)."""
    run_two(WORKER, str(tmp_path), "disagree")
    for pid in (0, 1):
        msg = (tmp_path / f"refused{pid}.txt").read_text()
        assert "copies disagree: process 0 at step 0" in msg and "process 1 at step 2" in msg
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
    # the failed collective, or (a loaded machine reaching no collective in time) the watch of
    # the peers' signs of life
    assert (last.startswith("jaxstream: process 0 of 2: a collective of the composed step "
                            "failed") and "a peer process is lost" in last) or last.startswith(
        "jaxstream: process 0 of 2: process 1 gave no sign of life"), last
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


EXPECT = {  # where process 1 dies in its second step: the copies' steps it may leave
    # after the step's collectives: process 0 commits step 2 alone, unless its peer watch ends
    # it first (a survivor more than peer_timeout_s behind)
    "before_commit": {(2, 1), (1, 1)},
    # process 1 committed step 2; process 0's check of the copies meets no one
    "after_commit": {(2, 2), (1, 2)},
    "mid_sweep": {(1, 1)},  # between two units: neither commits
}


@pytest.mark.slow
@pytest.mark.parametrize("point", list(EXPECT))
def test_a_killed_peer_ends_the_survivor_in_one_line_and_the_restart_settles_the_copies(
        tmp_path, point):
    """Process 1 dies (os._exit, as by SIGKILL) at a point of its second step. The survivor
    ends with exit status 2 and one line, never with JAX's abort; a copy left one step ahead
    (process 1 died between the two commits) is rolled back on the restart, naming both steps,
    and both processes then open the same commit. Before: at ``before_commit`` the survivor's
    check of the copies raised outside the step, its watch died at exit and JAX aborted it in
    the shutdown (SIGABRT, a C++ stack dump, 83 s after the death); the restart refused the
    copies at steps 2 and 1."""
    k: Kill = kill_once(tmp_path, point, victim=1, restart=None)  # restarts copies that differ
    assert k.survivor_rc == 2 and not k.aborted, k
    assert len(k.lines) == 1 and "restart every process" in k.lines[0], k
    assert k.steps in EXPECT[point], k
    lo, hi = min(k.steps), max(k.steps)
    assert k.opened == (f"agreed {lo}",) * 2, k
    if hi > lo:
        ahead = k.steps.index(hi)
        (line,) = k.restart_lines
        assert line.startswith(f"jaxstream: process {ahead} of 2: store copy") and (
            f"held step {hi}, which process(es) {1 - ahead} did not commit" in line) and (
            f"rolled back to step {lo}" in line), line
    else:
        assert k.restart_lines == [], k
