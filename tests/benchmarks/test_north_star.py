"""The north-star benchmark's plumbing: arguments, the blocking-transfer counter, idle per
cause summing to the excess, a one-round run of the smallest case, and the doc table."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import north_star as ns


def test_quick_is_width_256_and_few_rounds():
    args = ns.parse(["--quick"])
    assert args.widths == [256] and args.rounds == 3
    assert args.estimators == list(ns.ESTIMATORS) and args.caches == ["warm", "cold"]
    full = ns.parse([])
    assert full.widths == list(ns.WIDTHS) and full.rounds > args.rounds


@pytest.mark.parametrize("argv", [["--estimators", "sgd"], ["--caches", "hot"],
                                  ["--rounds", "0"], ["--widths", "0"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        ns.parse(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_counter_counts_materialisations_on_the_main_thread_only():
    from jax._src.array import ArrayImpl

    originals = (ArrayImpl.__array__, ArrayImpl.item, np.asarray, jax.device_get)
    counter = ns.BlockingCounter()
    with counter.installed():
        a = jnp.arange(4.0) * 2
        np.asarray(a)  # not counting yet
        with counter.counting():
            np.asarray(a + 1)
            np.asarray(np.ones(3))  # a host array: no transfer
            float((a * 3)[0])
            (a - 1)[1].item()
            (a * 5).block_until_ready()
            jax.device_get({"x": a + 2, "y": a + 3})  # one call, however many leaves
            worker = threading.Thread(target=lambda: np.asarray(a * 7))
            worker.start()
            worker.join()
        assert counter.count == 5  # not the host array's, not the worker's copy
        np.asarray(jnp.ones(2) + 1)
        assert counter.count == 5
    assert (ArrayImpl.__array__, ArrayImpl.item, np.asarray, jax.device_get) == originals


def test_idle_causes_and_other_sum_to_the_excess():
    mem = [1.0, 1.2, 0.8]
    steps = [{"wall_s": w, "stall_s": 0.1 * i, "wait_update_s": 0.2, "host_update_s": 9.0,
              "blocking": 4, "extra_s": 1.0} for i, w in enumerate([2.0, 3.0, 2.5])]
    steps[1]["wait_write_s"] = 0.3  # a field some steps lack is left out, not guessed
    r = ns.summarise(mem, steps)
    assert set(r["idle_s"]) == {"stall_s", "wait_update_s"}
    assert r["excess_s"] == pytest.approx(2.5 - 1.0)
    assert r["other_s"] + sum(r["idle_s"].values()) == pytest.approx(r["excess_s"])
    assert r["ratio"] == pytest.approx(2.5)
    assert (r["ratio_min"], r["ratio_max"]) == (pytest.approx(2.0), pytest.approx(3.0))


def test_device_idle_causes_are_preferred_when_reported():
    mem = [1.0]
    steps = [{"wall_s": 2.0, "stall_s": 0.5, "stall_idle_s": 0.2, "wait_update_s": 0.6,
              "wait_update_idle_s": 0.1, "wait_commit_s": 0.05, "wait_write_s": 0.3,
              "blocking": 1}]
    r = ns.summarise(mem, steps)
    assert list(r["idle_s"]) == list(ns.DEVICE_IDLE)
    assert r["other_s"] == pytest.approx(1.0 - 0.35)


def test_one_round_of_the_smallest_case(tmp_path):
    """Both caches of one estimator at width 16: every field the table reads is there."""
    res = ns.run([16], ["backprop"], ["warm", "cold"], rounds=1, log=lambda s: None)
    assert set(res) == {"16/backprop/warm", "16/backprop/cold"}
    for r in res.values():
        assert r["ratio"] > 0 and r["blocking"] >= 0 and r["memory_s"]["n"] == 1
        assert list(r["idle_s"]) == list(ns.DEVICE_IDLE)  # the executor's disjoint causes
        assert all(v >= 0 for v in r["idle_s"].values())
        assert r["other_s"] + sum(r["idle_s"].values()) == pytest.approx(r["excess_s"])
    doc = {"command": "python benchmarks/north_star.py --widths 16", "rounds": 1,
           "environment": ns.environment(), "results": res}
    md = ns.markdown(doc)
    assert md.count("\n| 16 | backprop |") == 2
    page = tmp_path / "streaming.md"
    page.write_text("intro\n<!-- generated: north_star.py table -->\nold\n<!-- end generated -->\n")
    ns.write_doc(str(page), doc, doc["command"])
    text = page.read_text()
    assert "| 16 | backprop | cold |" in text and "\nold\n" not in text
    assert "Written by `python benchmarks/north_star.py --widths 16`" in text


def test_doc_without_the_marker_is_one_error_line(tmp_path):
    page = tmp_path / "streaming.md"
    page.write_text("no table here\n")
    doc = {"command": "c", "rounds": 1, "environment": {"loadavg": [1, 1, 1], "depth": 8,
           "micro_batches": "8 x 16", "optimizer": "sgd", "compute_dtype": "float32",
           "prefetch": 2, "machine": "m"}, "results": {}}
    with pytest.raises(SystemExit, match="north_star.py table"):
        ns.write_doc(str(page), doc, "c")
    assert page.read_text() == "no table here\n"


def test_merge_keeps_every_width_in_order():
    env = {"machine": "m"}
    a = {"command": "x --widths 256", "rounds": 5, "environment": env, "results": {"256/b/w": 1}}
    b = {"command": "x --widths 1024", "rounds": 4, "environment": env, "results": {"1024/b/w": 2}}
    m = ns.merge([a, b])
    assert list(m["results"]) == ["256/b/w", "1024/b/w"] and m["rounds"] == "4–5"
    assert m["command"] == "x --widths 256; x --widths 1024"
    assert jax.tree.leaves(ns.merge([a])) == jax.tree.leaves(a)
