"""Failure paths of a streamed step: a failed commit retried in the same executor gives the
uninterrupted run's parameters (lazy, eager, hybrid, a hybrid's update deferred to the next
read: against the eager hybrid), and every write failure during a hybrid
step is a StoreWriteError (TensorStore's raw errors never surface)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream import store_commit as store_mod
from jaxstream.stream.errors import StoreWriteError
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(6, 8, 2, 3)
ADAM = optax.adam(1e-2)
CASES = {"lazy": (jg.forward(num_tangents=2, distribution="gaussian"), "lazy"),
         "hybrid": (jg.hybrid(num_exact=2, num_tangents=2), "eager"),
         "hybrid_lazy": (jg.hybrid(num_exact=2, num_tangents=2), "lazy")}


def _batch(t):
    r = np.random.default_rng(t)
    return {"x": r.standard_normal((4, 3, 6)).astype(np.float32),
            "y": r.integers(0, 3, (4, 3)).astype(np.int32)}


def _run(path, name, fail=None):
    """Three steps; ``fail(store, t)`` may install a failure for step t, undone on retry."""
    est, update = CASES[name]
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=ADAM)
    ex = StreamedExecutor(STACK, est, ADAM, store, StreamConfig(compute_dtype="float32", update=update))
    failures = 0
    for t in range(3):
        undo = fail(store, t) if fail else None
        try:
            ex.step(_batch(t), jax.random.key(10 + t))
        except StoreWriteError:
            failures += 1
            undo()
            ex.step(_batch(t), jax.random.key(10 + t))  # the retry, same executor
        else:
            assert undo is None, "the injected failure never fired"
    ex.flush()
    return LayerStore.open(path).read_params(), failures


def _failing_manifest(store, t):
    if t != 1:
        return None
    real = store_mod.write_manifest

    def boom(*a, **k):
        raise StoreWriteError("writing manifest.json failed (No space left on device)")

    store_mod.write_manifest = boom
    return lambda: setattr(store_mod, "write_manifest", real)


class _FullDisk:
    """A TensorStore view whose writes fail as TensorStore reports a full disk."""

    def __init__(self, view):
        self._view = view

    def __getitem__(self, idx):
        return self

    def read(self):
        return self._view.read()

    def write(self, x):
        class Fut:
            def done(self):
                return True

            def result(self):
                raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left")

        return Fut()


def _failing_scratch(store, t):
    if t != 1:
        return None
    real = store._scratch_array
    store._scratch_array = lambda part, i: _FullDisk(real(part, i))
    return lambda: setattr(store, "_scratch_array", real)


def _failing_carry(store, t):
    """Step 1's carry writes fail (step 0's records, to be applied then, name the other slot)."""
    if t != 1:
        return None
    real, arrays = store.write_carry, store._carry_array

    def failing(*args):  # only the writes fail: the reads of step 0's records still work
        store._carry_array = lambda *a, **k: _FullDisk(arrays(*a, **k))
        try:
            return real(*args)
        finally:
            store._carry_array = arrays

    store.write_carry = failing
    return lambda: setattr(store, "write_carry", real)


@pytest.mark.parametrize("name, fail", [("lazy", _failing_manifest), ("hybrid", _failing_scratch),
                                        ("hybrid_lazy", _failing_carry),
                                        ("hybrid_lazy", _failing_manifest)])
def test_retried_step_equals_uninterrupted_run(tmp_path, name, fail):
    want, _ = _run(tmp_path / "ref", "hybrid" if name == "hybrid_lazy" else name)
    got, failures = _run(tmp_path / "failed", name, fail)
    assert failures == 1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
