"""``rewrite_every=k``: a forward estimator's updates replayed from their keys on read, the
layer written back only every k records — bitwise the eager updates, and the in-memory
estimator's training within float32 rounding."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, lazy
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(5, 7, 3, 4)
EST = jg.forward(num_tangents=2)
OPT = optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(3e-2, momentum=0.9))
STEPS = 7


def _batch(t: int) -> dict:
    r = np.random.default_rng(100 + t)
    return {"x": r.standard_normal((2, 4, 5)).astype(np.float32),
            "y": r.integers(0, 4, (2, 4)).astype(np.int32)}


def _key(t: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(7), t)


def _streamed(path, **cfg) -> tuple[list, dict]:
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=OPT)
    ex = StreamedExecutor(STACK, EST, OPT, store, StreamConfig(compute_dtype="float32", **cfg))
    for t in range(STEPS):
        ex.step(_batch(t), _key(t))
    pending = {k: len(v) for k, v in lazy.waiting(store.extra).items()}
    ex.flush()
    assert not any(lazy.waiting(store.extra).values())
    return jax.tree.leaves(store.read_params()), pending


def _in_memory() -> list:
    """The in-memory estimator and optax, no store: the same training, one jitted step (run
    before any executor starts its threads)."""

    @jax.jit
    def step(params, state, batch, key):
        _, g = EST(STACK, params, batch, key)
        upd, state = OPT.update(g, state, params)
        return optax.apply_updates(params, upd), state

    params = STACK.init(jax.random.key(0))
    state = OPT.init(params)
    for t in range(STEPS):
        params, state = step(params, state, _batch(t), _key(t))
    return jax.tree.leaves(params)


@pytest.mark.parametrize("k", [2, 5])
def test_replayed_updates_equal_the_eager_path_bitwise(tmp_path, k):
    reference = _in_memory()
    eager, _ = _streamed(tmp_path / "eager", update="eager")
    lazy, waiting = _streamed(tmp_path / "lazy", update="lazy", rewrite_every=k)
    assert set(waiting.values()) == {STEPS % k or k}  # records were waiting at the end
    for a, b in zip(eager, lazy):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(reference, lazy):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg, field", [
    ({"update": "lazy", "rewrite_every": 0}, "rewrite_every must be an int >= 1"),
    ({"update": "eager", "rewrite_every": 2}, "needs update='lazy'")])
def test_bad_rewrite_every_is_refused_by_name(cfg, field):
    with pytest.raises(ValueError, match=field):
        StreamConfig(**cfg)


def test_each_record_is_committed_once_and_old_manifests_still_resume(tmp_path):
    """A step's record waits for every layer the step did not rewrite: the manifest holds it
    once, the layers name it by index. A store committed with the records spelled per layer
    (as manifests were written before) resumes to the same parameters, bitwise."""
    import json
    import shutil

    path = tmp_path / "a"
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=OPT)
    cfg = StreamConfig(compute_dtype="float32", update="lazy", rewrite_every=5)
    ex = StreamedExecutor(STACK, EST, OPT, store, cfg)
    for t in range(3):
        ex.step(_batch(t), _key(t))
    ex.close()
    store.settle()
    committed = store.extra["pending"]
    per_layer = lazy.waiting(store.extra)
    units = sorted(per_layer)
    # every unit waits (the embed and head too: a commit's records are its whole update)
    assert units == sorted(["embed", "head", *map(str, range(STACK.num_layers))])
    assert all(len(per_layer[u]) == 3 for u in units)
    assert len(committed["records"]) == 3  # one per step, not one per layer and step
    assert committed["fresh"] == {"records": [2], "since": 2}  # the last step's, taken back
                                                               # by a rollback to this commit
    spelled = json.dumps(per_layer, sort_keys=True)
    assert len(json.dumps(committed, sort_keys=True)) < len(spelled) / 2
    # the same store with the per-layer spelling committed at the same step
    shutil.copytree(path, tmp_path / "b")
    old = LayerStore.open(tmp_path / "b", optimizer=OPT)
    old.commit(old.step, extra={**old.extra, "pending": per_layer})
    assert LayerStore.open(tmp_path / "b").extra["pending"] == json.loads(spelled)
    leaves = []
    for p in (path, tmp_path / "b"):
        s = LayerStore.open(p, optimizer=OPT)
        ex = StreamedExecutor(STACK, EST, OPT, s, cfg)
        for t in range(3, 6):
            ex.step(_batch(t), _key(t))
        ex.flush()
        ex.close()
        leaves.append(jax.tree.leaves(s.read_params()))
    for a, b in zip(*leaves):
        np.testing.assert_array_equal(a, b)
