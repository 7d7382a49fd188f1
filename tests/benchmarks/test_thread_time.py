"""The streaming benchmark's per-thread accounting: the busiest thread is found, and a sweep
splits into the compute thread's run / wait / idle time and the others'."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import thread_time as tt

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # on-CPU time, whatever else runs
        pass


def test_busiest_is_the_thread_that_computed():
    """Of the threads alive over the window, the one that spun is found, not one that slept.
    The spin starts inside the window (after the first snapshot), and threads that existed
    before (a loaded test process has busy ones of earlier tests) are left out, as the
    benchmark leaves out its main thread."""
    box, go, spun, release = {}, threading.Event(), threading.Event(), threading.Event()

    def worker():
        box["tid"] = threading.get_native_id()
        go.wait()
        _spin(0.6)
        spun.set()
        release.wait()  # alive at the second snapshot, as XLA's compute thread is

    def sleeper():
        box["idle"] = threading.get_native_id()
        release.wait()

    before = set(tt.snapshot())
    threads = [threading.Thread(target=f) for f in (sleeper, worker)]
    for t in threads:
        t.start()

    def window():
        go.set()
        spun.wait()

    try:
        found = tt.busiest(window, before)
    finally:
        go.set()
        release.set()
        for t in threads:
            t.join()
    assert found == box["tid"] != box["idle"]


def test_split_adds_up_against_a_known_snapshot():
    a = {1: (0, 0), 2: (5_000_000, 1_000_000), 3: (0, 0)}
    b = {1: (30_000_000, 2_000_000), 2: (65_000_000, 3_000_000), 3: (7_000_000, 4_000_000),
         4: (1_000_000, 0)}  # thread 4 started during the sweep
    s = tt.split(a, b, wall_s=0.1, compute=2, main=1)
    assert s["compute_run_s"] == pytest.approx(0.060)
    assert s["compute_wait_s"] == pytest.approx(0.002)
    assert s["compute_idle_s"] == pytest.approx(0.1 - 0.060 - 0.002)
    assert (s["main_run_s"], s["main_wait_s"]) == pytest.approx((0.030, 0.002))
    assert (s["other_run_s"], s["other_wait_s"]) == pytest.approx((0.008, 0.004))


def test_snapshot_counts_a_spinning_thread():
    a = tt.snapshot()
    _spin(0.05)
    b = tt.snapshot()
    me = threading.get_native_id()
    assert (b[me][0] - a[me][0]) / 1e9 >= 0.05 * 0.9


def test_split_counts_a_thread_that_ended_within_the_sweep():
    me = threading.get_native_id()
    a, c0 = tt.snapshot(), time.process_time()
    box = {}

    def worker():
        box["tid"] = threading.get_native_id()
        _spin(0.1)

    t = threading.Thread(target=worker)  # lives only between the snapshots
    t.start()
    t.join()
    end = time.monotonic() + 5
    while os.path.exists(f"/proc/self/task/{box['tid']}") and time.monotonic() < end:
        time.sleep(0.001)  # join returns a moment before the kernel removes the thread
    b, cpu = tt.snapshot(), time.process_time() - c0
    assert box["tid"] not in b
    alive_only = tt.split(a, b, wall_s=0.2, compute=None, main=me)
    counted = tt.split(a, b, wall_s=0.2, compute=None, main=me, process_cpu_s=cpu)
    # the ended thread is in neither snapshot; the process time adds it (whatever other live
    # threads of this process, e.g. a test worker's, ran meanwhile: they are in both)
    assert counted["other_run_s"] - alive_only["other_run_s"] >= 0.1 * 0.9
