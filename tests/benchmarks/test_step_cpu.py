"""The step-CPU benchmark's plumbing: CPU per thread adds up to the process's, the floor
column is CPU / 2 cores over the in-memory wall time, and the doc block is written from JSON."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_cpu as sc

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux only")


def test_cpu_per_thread_name_and_ended_threads():
    """Live threads are counted by their OS name (Python threads all share the process's);
    a thread that ends inside the window (a third of the work here) is in "ended"; together
    they make up the process's CPU."""
    a = np.random.default_rng(0).standard_normal((300, 300))
    release = threading.Event()

    def busy():
        for _ in range(30):
            a @ a

    live = threading.Thread(target=lambda: (busy(), release.wait()), name="side")

    def work(i):
        if i == 0:
            live.start()
        gone = threading.Thread(target=busy)
        gone.start()
        gone.join()
        busy()

    try:
        r = sc.measure(work, 2)
    finally:
        release.set()
        live.join()
    th = r["threads_s"]
    assert th["ended"] > 0.1 * r["cpu_s"] and max(v for k, v in th.items() if k != "ended") > 0
    assert sum(th.values()) == pytest.approx(r["cpu_s"], rel=1e-6, abs=1e-6)


def test_table_and_doc_from_json(tmp_path):
    side = lambda wall, cpu, ts: {"wall_s": wall, "cpu_s": cpu,
                                  "threads_s": {"tf_XLAEigen": cpu - ts, "ts_pool_worker": ts}}
    doc = {"command": "python benchmarks/step_cpu.py --widths 8", "estimator": "backprop",
           "steps": 1, "environment": {"machine": "a test machine"},
           "results": {"8": {"memory": side(0.010, 0.018, 0.0),
                             "streamed": side(0.030, 0.050, 0.020)}}}
    row = sc.table(doc["results"], "backprop").splitlines()[-1]
    assert row.startswith("| 8 | streamed (backprop) | 30.0 | 50.0 | 1.67 | 30.0 |")
    assert row.endswith("| 20.0 | 0.0 | 2.50 |")  # 0.050 s / 2 cores / 0.010 s in memory
    src, page = tmp_path / "cpu.json", tmp_path / "page.md"
    src.write_text(json.dumps(doc))
    page.write_text("x\n<!-- generated: step_cpu.py table -->\n<!-- end generated -->\n")
    sc.main(["--from-json", str(src), "--doc", str(page)])
    text = page.read_text()
    assert row in text and "Written by `python benchmarks/step_cpu.py --widths 8`" in text
    assert "a test machine" in text
