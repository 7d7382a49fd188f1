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
    # elementwise NumPy (runs on the calling thread; a matmul may run on BLAS's own threads,
    # which are live threads, so the ended thread's share would land there)
    a = np.random.default_rng(0).standard_normal(200_000)
    release = threading.Event()

    def busy():
        for _ in range(30):
            np.exp(np.sin(a))

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


def test_floors_and_the_doc_from_json(tmp_path):
    side = lambda wall, cpu, ts: {"wall_s": wall, "cpu_s": cpu,
                                  "threads_s": {"tf_XLAEigen": cpu - ts, "ts_pool_worker": ts}}
    mem, st = side(0.010, 0.018, 0.0), side(0.030, 0.050, 0.020)
    st.update(bytes_read=2 * 2**20, bytes_written=2**20)
    io = {"write_s_per_byte": 1e-3 / 2**20, "read_s_per_byte": 0.5e-3 / 2**20}
    f = sc.floor(mem, st, io, 2)
    assert f["io_cpu_s"] == pytest.approx(2e-3)  # 1 MiB written at 1 ms, 2 MiB read at 0.5
    assert f["this_implementation"] == pytest.approx(0.050 / 2 / 0.010)
    assert f["any_implementation"] == pytest.approx((0.018 + 0.002) / 2 / 0.010)
    doc = {"command": "python benchmarks/step_cpu.py --widths 8", "estimator": "backprop",
           "steps": 1, "environment": {"machine": "a test machine"},
           "results": {"8": {"memory": mem, "streamed": st, "io": io, "floor": f}}}
    text = sc.table(doc["results"], "backprop")
    row = text.splitlines()[3]
    assert row.startswith("| 8 | streamed (backprop) | 30.0 | 50.0 | 1.67 | 30.0 |")
    assert row.endswith("| 2.0 / 1.0 | **2.50** | **1.00** |")
    assert "write 1.00, read 0.50" in text
    src, page = tmp_path / "cpu.json", tmp_path / "page.md"
    src.write_text(json.dumps(doc))
    page.write_text("x\n<!-- generated: step_cpu.py table -->\n<!-- end generated -->\n")
    sc.main(["--from-json", str(src), "--doc", str(page)])
    out = page.read_text()
    assert row in out and "Written by `python benchmarks/step_cpu.py --widths 8`" in out
    assert "a test machine" in out
    # a run of several estimators: one table each, in the order measured
    two = {**{k: v for k, v in doc.items() if k not in ("estimator", "results")},
           "runs": {"backprop": doc["results"], "hybrid_eager": doc["results"]}}
    src.write_text(json.dumps(two))
    sc.main(["--from-json", str(src), "--doc", str(page)])
    out = page.read_text()
    assert out.index("streamed (backprop)") < out.index("streamed (hybrid_eager)")
    assert out.count("| width | side |") == 2
    # the goals: width 8 has none; at 1024 the floor 1.00 leaves 1.25 open, 1.30 excludes it
    assert "out of reach on this machine by the second floor" in out and "none" in out
    wide = {**doc["results"]["8"], "floor": {**f, "any_implementation": 1.30}}
    said = sc.excluded({"backprop": {"1024": {**doc["results"]["8"]}}, "hybrid_eager": {"1024": wide}})
    assert "hybrid_eager at 1024 (1.30 > 1.25)" in said.split("Within")[0]
    assert "backprop at 1024 (1.00 ≤ 1.25)" in said.split("Within")[1]
    assert said.split("Of those")[1].count(" at ") == 1 and "backprop at 1024 (2.50)" in said


def test_io_costs_are_positive(tmp_path):
    io = sc.io_costs(1 << 16, tmp_path, repeat=2)
    assert io["write_s_per_byte"] > 0 and io["read_s_per_byte"] >= 0
    assert not list(tmp_path.iterdir())  # its files are removed
