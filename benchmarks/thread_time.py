"""Where a sweep's wall time goes, per thread: on-CPU time, runnable-but-waiting time, idle.

Linux keeps, for every thread, the nanoseconds it ran and the nanoseconds it waited on a
run queue (``/proc/self/task/<tid>/schedstat``, fields 1 and 2). For the thread that runs
XLA's computation, ``wall - run - wait`` is the time it had nothing to compute: the
streamed sweep starving it (a late read, the dispatching thread busy or waiting for the
GIL). ``wait`` is time it was ready but another thread held its core.

    before = snapshot()
    ...                                    # the sweep
    split(before, snapshot(), wall_s, compute_tid)

Used by ``benchmarks/streaming.py`` (overlap section). Linux only; elsewhere the snapshot is
empty and every figure is 0.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

Snapshot = dict[int, tuple[int, int]]


def snapshot() -> Snapshot:
    """``{tid: (run_ns, runqueue_wait_ns)}`` of every thread of this process."""
    out: Snapshot = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                run, wait = fh.read().split()[:2]
            out[int(tid)] = (int(run), int(wait))
        except (OSError, ValueError):
            pass  # the thread ended meanwhile
    return out


def busiest(fn: Callable[[], object], exclude: set[int]) -> int | None:
    """The thread (not in ``exclude``) that ran longest while ``fn`` ran: XLA's compute
    thread when ``fn`` is a compute loop that is already compiled (a compilation runs on
    other threads). Only threads alive after ``fn`` count."""
    a = snapshot()
    fn()
    b = snapshot()
    ran = {t: b[t][0] - a.get(t, (0, 0))[0] for t in b if t not in exclude}
    return max(ran, key=ran.get) if ran else None


def split(a: Snapshot, b: Snapshot, wall_s: float, compute: int | None,
          main: int | None = None, process_cpu_s: float | None = None) -> dict[str, float]:
    """Seconds of a sweep that took ``wall_s``: the compute thread's run / wait / idle, the
    dispatching (main) thread's run / wait and every other thread's (the reads) summed.

    A thread that starts and ends between the two snapshots (a prefetcher's pool, which
    lives for one sweep) is in neither: pass the process's CPU time over the sweep
    (``time.process_time()`` difference) and ``other_run_s`` is that minus the compute and
    main threads' run time, which counts them; ``other_wait_s`` covers live threads only.
    """
    main = threading.main_thread().native_id if main is None else main
    d = {t: ((b[t][0] - a.get(t, (0, 0))[0]) / 1e9, (b[t][1] - a.get(t, (0, 0))[1]) / 1e9) for t in b}
    run = lambda t: d.get(t, (0.0, 0.0))[0]
    wait = lambda t: d.get(t, (0.0, 0.0))[1]
    others = [t for t in d if t not in (compute, main)]
    other_run = sum(run(t) for t in others)
    if process_cpu_s is not None:
        other_run = max(other_run, process_cpu_s - run(compute) - run(main))
    return {"compute_run_s": run(compute), "compute_wait_s": wait(compute),
            "compute_idle_s": max(0.0, wall_s - run(compute) - wait(compute)),
            "main_run_s": run(main), "main_wait_s": wait(main),
            "other_run_s": other_run, "other_wait_s": sum(wait(t) for t in others)}


def pin(compute: int, core: int, rest: set[int]) -> bool:
    """Gives the compute thread ``core`` alone and every other thread (the main thread
    included, so threads it starts later inherit it) the cores ``rest``. False where the
    affinity cannot be set."""
    ok = True
    for t in snapshot():
        try:
            os.sched_setaffinity(t, {core} if t == compute else rest)
        except OSError:
            ok = False
    return ok
