"""``StreamConfig(updates_in_flight=n)``: up to n units' host updates queued beside the compute.
The queue never holds more than n, runs them in order, and a streamed run with a slow host
(every write delayed, so the queue really fills) ends bit for bit where the one-in-flight run
ends, for every estimator the streamed engine runs."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from jaxstream.stream.host_queue import HostQueue

STACK = mlp(6, 8, 4, 3)
ADAM = optax.adam(1e-2)


def test_the_queue_holds_at_most_n_and_runs_them_in_order():
    q = HostQueue(None, None, None, in_flight=2)
    gate, ran = threading.Event(), []
    q.submit(lambda: (gate.wait(10), ran.append(0)))
    q.submit(lambda: ran.append(1))  # queued behind the first: returns at once
    third = threading.Thread(target=lambda: q.submit(lambda: ran.append(2)))
    third.start()
    time.sleep(0.2)
    assert third.is_alive() and ran == []  # the third waits for the oldest to finish
    gate.set()
    third.join(10)
    q.shutdown()
    assert ran == [0, 1, 2]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_count_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"updates_in_flight must be an int >= 1, got"):
        StreamConfig(updates_in_flight=bad)


def _batch(t):
    r = np.random.default_rng(t)
    return {"x": r.standard_normal((4, 3, 6)).astype(np.float32),
            "y": r.integers(0, 3, (4, 3)).astype(np.int32)}


def _train(path, est, in_flight, slow_writes, **options):
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=ADAM)
    if slow_writes:  # a slow host: each staged write takes 5 ms more, so updates queue up
        write = store.write
        store.write = lambda *a, **k: (time.sleep(0.005), write(*a, **k))[1]
    cfg = StreamConfig(compute_dtype="float32", updates_in_flight=in_flight, **options)
    ex = StreamedExecutor(STACK, est, ADAM, store, cfg)
    try:
        losses = [float(ex.step(_batch(t), jax.random.key(10 + t))["loss"]) for t in range(3)]
        ex.flush()
    finally:
        ex.close()
    return LayerStore.open(path).read_params(), losses


@pytest.mark.parametrize("name, est, options", [
    ("backprop", jg.backprop(), {}),
    ("forward weights, lazy", jg.forward(num_tangents=2), {"update": "lazy", "rewrite_every": 2}),
    ("forward activations", jg.forward(num_tangents=1, perturb="activations"), {}),
    ("hybrid", jg.hybrid(num_exact=2, correction="control_variate"), {}),
    ("hybrid, lazy", jg.hybrid(num_exact=2, correction="control_variate"), {"update": "lazy"}),
], ids=lambda v: v if isinstance(v, str) else "")
def test_more_updates_in_flight_end_where_one_does(tmp_path, name, est, options):
    want, want_losses = _train(tmp_path / "one", est, 1, False, **options)
    got, losses = _train(tmp_path / "three", est, 3, True, **options)
    assert losses == want_losses, name
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


def test_yaml_sets_it_on_the_stream_engine_and_the_composed_engine_refuses_it():
    from jaxstream.experiment import load_experiment
    from jaxstream.experiment.config_yaml import ConfigError

    base = {"kind": "train", "model": {"type": "mlp", "depth": 4},
            "arms": [{"name": "bp", "estimator": {"type": "backprop"}}]}
    _, cfg = load_experiment({**base, "engine": {"type": "stream", "updates_in_flight": 2}})
    assert cfg.engine.updates_in_flight == 2
    with pytest.raises(ConfigError, match=r"engine.updates_in_flight: must be >= 1, got 0"):
        load_experiment({**base, "engine": {"type": "stream", "updates_in_flight": 0}})
    with pytest.raises(ConfigError, match=r"engine.updates_in_flight: the composed engine keeps "
                                          r"one unit's host update in flight .* allowed: 1, got 2"):
        load_experiment({**base, "engine": {"type": "composed", "stage": 2,
                                            "updates_in_flight": 2}})


def test_a_with_block_closes_the_executor_and_ends_its_worker(tmp_path):
    """``with StreamedExecutor(...) as ex``: on leaving the block the host updates have landed
    and the host-update thread has ended (a notebook building executors in a loop leaves no
    idle thread behind); the store stays open and committed."""
    def workers():  # other tests' executors may end (be collected) meanwhile: not counted
        return {t for t in threading.enumerate() if t.name.startswith("jaxstream-host-update")}

    before = workers()
    store = LayerStore.create(tmp_path / "s", STACK.init(jax.random.key(0)), optimizer=ADAM)
    with StreamedExecutor(STACK, jg.backprop(), ADAM, store,
                          StreamConfig(compute_dtype="float32")) as ex:
        ex.step(_batch(0), jax.random.key(1))
        mine = workers() - before
        assert len(mine) == 1 and all(t.is_alive() for t in mine)
    assert not any(t.is_alive() for t in mine)
    assert LayerStore.open(tmp_path / "s").step == 1


def test_the_composed_executor_refuses_more_than_one_in_flight(tmp_path):
    """The Python API refuses what the YAML check refuses, before any compute."""
    from jaxstream.compose import ComposedExecutor, make_mesh

    store = LayerStore.create(tmp_path / "s", STACK.init(jax.random.key(0)), optimizer=ADAM)
    with pytest.raises(ValueError, match=r"updates_in_flight: the composed engine keeps one "
                                         r"unit's host update in flight .* allowed: 1, got 2"):
        ComposedExecutor(STACK, jg.backprop(), ADAM, store,
                         StreamConfig(compute_dtype="float32", updates_in_flight=2),
                         mesh=make_mesh(1, 2))
