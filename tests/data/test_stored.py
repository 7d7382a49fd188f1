"""A data set in a second TensorStore: the batches read per step are the in-memory data set's,
so a run on the store equals the run on the data it was written from (local and streamed
engines); the next batch is read ahead; a missing store is one line."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from jaxstream.cli import user_error_line
from jaxstream.data.batches import batch_at
from jaxstream.data.digits import load_digits
from jaxstream.data.stored import _Prefetched, batch_source, open_data_store, write_data_store
from jaxstream.experiment.rundir import MetricsLog, strip_time_fields
from jaxstream.experiment.runner import run_experiment
from jaxstream.stream.errors import StoreNotFoundError

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
STREAM = ROOT / "experiments" / "stream_mlp.yaml"
TINY = ["steps=4", "eval_every=2", "diag_every=0", "checkpoint_every=2", "model.width=8",
        "model.depth=2", "batch_size=16", "plots=false", "progress=false",
        "arms=[{name: fwd, estimator: {type: forward, num_tangents: 2}, lr: 0.01}]"]


def test_the_stored_data_set_is_the_data_set(tmp_path):
    data = load_digits(3)
    write_data_store(data, tmp_path / "d", chunk_samples=100)
    got = open_data_store(tmp_path / "d")
    assert got.info == data.info and getattr(got.train, "streamed", False)
    for k in data.train:
        np.testing.assert_array_equal(np.asarray(got.train[k]), data.train[k])
        np.testing.assert_array_equal(got.test[k], data.test[k])
        assert got.train[k].dtype == data.train[k].dtype
    for step in (0, 1, 57):  # the same batches, across chunk boundaries and epochs
        a, b = batch_at(got.train, 32, 3, step), batch_at(data.train, 32, 3, step)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_next_batch_is_read_ahead():
    asked, gate = [], threading.Event()

    def read(step):
        asked.append(step)
        if step == 1:
            gate.set()
        return {"x": np.full(2, step)}

    fetch = _Prefetched(read)
    assert fetch(0)["x"][0] == 0
    assert gate.wait(30)  # step 1 is read before anyone asks for it
    assert fetch(1)["x"][0] == 1 and asked[:2] == [0, 1]
    assert fetch(7)["x"][0] == 7  # out of order: read in line
    assert batch_source({"x": np.arange(10)}, 2, 0)(3)["x"].shape == (2,)  # in memory: direct


@pytest.mark.parametrize("config", [QUICKSTART, STREAM])
def test_a_run_on_the_store_equals_the_run_on_the_data(tmp_path, config):
    write_data_store(load_digits(0), tmp_path / "digits")
    a, _ = run_experiment(config, [*TINY, "data={type: digits}"], out=tmp_path / "mem")
    b, _ = run_experiment(config, [*TINY, f"data={{type: store, path: {tmp_path / 'digits'}}}"],
                          out=tmp_path / "store")
    ma = [strip_time_fields(r) for r in MetricsLog(a / "metrics.jsonl").read()]
    mb = [strip_time_fields(r) for r in MetricsLog(b / "metrics.jsonl").read()]
    assert len(ma) == 5 and ma == mb


def test_a_missing_data_store_is_one_line(tmp_path):
    with pytest.raises(StoreNotFoundError, match="info.json is missing") as e:
        run_experiment(QUICKSTART, [*TINY, f"data={{type: store, path: {tmp_path / 'no'}}}"],
                       out=tmp_path / "run")
    assert "\n" not in user_error_line(e.value) and not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="data.path: the data store's directory is required"):
        run_experiment(QUICKSTART, [*TINY, "data={type: store}"], out=tmp_path / "run")
