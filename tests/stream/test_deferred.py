"""A hybrid's update deferred to each layer's next read (``update="lazy"``): the store after
every step equals the eager update sweep's, bit for bit, with one read of every layer fewer per
step; the records are committed, refused when another estimator would apply them, and their
carried values are checked on read."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, lazy
from jaxstream.stream.depth import DepthPolicy
from jaxstream.stream.errors import StoreError
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(6, 8, 4, 3)
ADAM = optax.adam(1e-2)
L = STACK.num_layers


def _batch(t):
    r = np.random.default_rng(t)
    return {"x": r.standard_normal((4, 3, 6)).astype(np.float32),
            "y": r.integers(0, 3, (4, 3)).astype(np.int32)}


def _train(path, est, update, steps=3, depth=None):
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=ADAM)
    cfg = StreamConfig(compute_dtype="float32", update=update, depth=depth or DepthPolicy())
    ex = StreamedExecutor(STACK, est, ADAM, store, cfg)
    reads = [ex.step(_batch(t), jax.random.key(10 + t))["layers_read"] for t in range(steps)]
    pending = lazy.waiting(LayerStore.open(path).extra)
    ex.flush()
    return LayerStore.open(path).read_params(), reads, pending


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


# reads per step of L = 4 layers, one device: forward L, reverse L - 1 (its first layer is the
# forward's last, still resident), the eager update sweep L; the guess sweeps along h once more
@pytest.mark.parametrize("correction, eager_reads, lazy_reads", [
    ("control_variate", 3 * L - 1, 2 * L - 1), ("weighted", 3 * L - 1, 2 * L - 1),
    ("stein", 3 * L - 1, 2 * L - 1), ("guess", 4 * L - 1, 3 * L - 1),
    ("replace", 2 * L - 1, 2 * L - 1)])
def test_deferred_equals_eager(tmp_path, correction, eager_reads, lazy_reads):
    est = jg.hybrid(num_exact=2, num_tangents=2, correction=correction)
    want, reads, none = _train(tmp_path / "eager", est, "eager")
    got, lazy, pending = _train(tmp_path / "lazy", est, "lazy")
    _equal(got, want)
    assert reads == [eager_reads] * 3 and lazy == [lazy_reads] * 3
    assert not any(none.values())
    if correction == "replace":  # updated in its reverse sweep: nothing to defer
        assert not any(pending.values())
    else:  # one committed record per unit, naming its rule and carry slot
        assert sorted(pending) == sorted(["embed", "head", *map(str, range(L))])
        assert all(len(r) == 1 and r[0]["combine"] == correction and r[0]["slot"] in (0, 1)
                   for r in pending.values())


def test_deferred_with_skipped_layers_equals_eager(tmp_path):
    """Stochastic depth: a skipped layer keeps its record (and its carry slot) until a step
    reads it again."""
    est = jg.hybrid(num_exact=2, num_tangents=2, correction="weighted")
    depth = DepthPolicy(kind="stochastic", keep_prob=0.5, seed=1)
    want, reads, _ = _train(tmp_path / "eager", est, "eager", steps=5, depth=depth)
    got, _, _ = _train(tmp_path / "lazy", est, "lazy", steps=5, depth=depth)
    assert len(set(reads)) > 1  # the steps really ran different layers
    _equal(got, want)


def test_estimate_between_steps_keeps_the_records(tmp_path):
    est = jg.hybrid(num_exact=2, num_tangents=2)
    store = LayerStore.create(tmp_path / "s", STACK.init(jax.random.key(0)), optimizer=ADAM)
    ex = StreamedExecutor(STACK, est, ADAM, store, StreamConfig(compute_dtype="float32",
                                                                update="lazy"))
    ex.step(_batch(0), jax.random.key(10))
    before = json.dumps(LayerStore.open(tmp_path / "s").extra, sort_keys=True)
    params = store.read_params()
    ex.estimate(_batch(1), jax.random.key(11))
    after = LayerStore.open(tmp_path / "s")
    assert after.step == 1 and json.dumps(after.extra, sort_keys=True) == before
    _equal(after.read_params(), params)


def test_records_of_another_rule_and_damaged_carry_are_refused(tmp_path):
    est = jg.hybrid(num_exact=2, num_tangents=2, correction="control_variate")
    store = LayerStore.create(tmp_path / "p", STACK.init(jax.random.key(0)), optimizer=ADAM)
    ex = StreamedExecutor(STACK, est, ADAM, store, StreamConfig(compute_dtype="float32",
                                                                update="lazy"))
    ex.step(_batch(0), jax.random.key(10))
    other = jg.hybrid(num_exact=2, num_tangents=2, correction="stein")
    ex2 = StreamedExecutor(STACK, other, ADAM, LayerStore.open(tmp_path / "p", optimizer=ADAM),
                           StreamConfig(compute_dtype="float32", update="lazy"))
    with pytest.raises(ValueError, match="combine rule 'control_variate'.*'stein'.*flush"):
        ex2.step(_batch(1), jax.random.key(11))
    # a carry chunk holding other values than its record's: refused by name, store unchanged
    rec = lazy.waiting(store.extra)["1"][0]
    arr = store._carry_array("blocks", 0)
    arr[1, rec["slot"]].write(np.full(arr.shape[2:], 7.0, np.float32)).result()
    ex3 = StreamedExecutor(STACK, est, ADAM, LayerStore.open(tmp_path / "p", optimizer=ADAM),
                           StreamConfig(compute_dtype="float32", update="lazy"))
    with pytest.raises(StoreError, match="carry leaf 0 of layer 1"):
        ex3.step(_batch(1), jax.random.key(11))
    assert LayerStore.open(tmp_path / "p").step == 1


def test_lazy_needs_an_update_it_can_defer(tmp_path):
    store = LayerStore.create(tmp_path / "s", STACK.init(jax.random.key(0)), optimizer=ADAM)
    with pytest.raises(ValueError, match="update='lazy' needs the forward estimator"):
        StreamedExecutor(STACK, jg.forward(perturb="activations"), ADAM, store,
                         StreamConfig(update="lazy"))


def test_backprop_with_lazy_is_backprop(tmp_path):
    """Backprop updates in its reverse sweep: ``update="lazy"`` defers nothing (one config can
    run backprop beside the hybrids), reading 2 L − 1 layers per step either way."""
    want, reads, _ = _train(tmp_path / "eager", jg.backprop(), "eager", steps=2)
    got, lazy, pending = _train(tmp_path / "lazy", jg.backprop(), "lazy", steps=2)
    _equal(got, want)
    assert reads == lazy == [2 * L - 1] * 2 and not any(pending.values())


def test_a_deferred_combine_is_committed_once_with_each_units_carry(tmp_path):
    """A step's deferred combine is the same record for every unit but its carry slot and
    crc32c: the manifest holds the step's part once and each unit's own fields beside its
    index, and reading it back gives every unit its whole record."""
    est = jg.hybrid(num_exact=2, num_tangents=2, correction="control_variate")
    _, _, pending = _train(tmp_path / "p", est, "lazy", steps=2)
    store = LayerStore.create(tmp_path / "q", STACK.init(jax.random.key(0)), optimizer=ADAM)
    ex = StreamedExecutor(STACK, est, ADAM, store,
                          StreamConfig(compute_dtype="float32", update="lazy"))
    ex.step(_batch(0), jax.random.key(10))
    ex.close()
    committed = store.extra["pending"]
    assert len(committed["records"]) == 1
    assert all(set(e[1]) == {"slot", "crc"} for es in committed["waiting"].values() for e in es)
    back = lazy.waiting(store.extra)
    assert sorted(back) == sorted(["embed", "head", *map(str, range(L))])
    assert len({r[0]["slot"] for r in back.values()}) == 1  # every unit's first carry slot
    assert len({tuple(r[0]["crc"]) for r in back.values()}) == len(back)  # each its own h_u
    assert all(r[0]["combine"] == "control_variate" for r in back.values())
    assert all(len(r) == 1 for r in pending.values())
