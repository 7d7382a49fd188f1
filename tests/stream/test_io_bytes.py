"""Bytes read and written per step, by kind, against a formula from the model's shapes.

Each expected number is the bytes of the units a step must move (from the parameter shapes
and the optimizer state's shapes) times how often the estimator's sweeps move them:

* backprop: forward L blocks, reverse L - 1 (its first block is the forward's last, still
  resident); every unit's update reads and writes its optimizer state and writes it;
* forward, eager: forward L, the update sweep L; lazy: forward L, each block's replayed update
  written on that read, embed and head updated at once;
* control-variate hybrid: forward L, reverse L - 1 (the model's parameter count comes from the
  store's leaf table, no read); eager: the update sweep L, every unit's group mean written to and read from scratch;
  lazy: no update sweep, the group means written to the carry and read back at the next read.

The manifest: read once per step (the writer's check at its first write: the file as the step
found it), written once (the file the commit left); the deferred records inside it.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.compose import ComposedExecutor, make_mesh
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, lazy
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(6, 8, 4, 3)
ADAM = optax.adam(1e-2)
L = STACK.num_layers
HYBRID = jg.hybrid(num_exact=2, num_tangents=2)  # control variate
FORWARD = jg.forward(num_tangents=2)


def _batch(t: int) -> dict:
    r = np.random.default_rng(t)
    return {"x": r.standard_normal((4, 3, 6)).astype(np.float32),
            "y": r.integers(0, 3, (4, 3)).astype(np.int32)}


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def _units() -> dict:
    """Bytes of each unit's fp32 parameters and Adam state, from the shapes alone."""
    shapes = jax.eval_shape(STACK.init, jax.random.key(0))
    block = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), shapes["blocks"])
    out = {}
    for name, tree in (("embed", shapes["embed"]), ("block", block), ("head", shapes["head"])):
        f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, np.float32), tree)
        out[name] = (_nbytes(f32), _nbytes(jax.eval_shape(ADAM.init, f32)))
    return out


U = _units()
P_ENDS, P_B = U["embed"][0] + U["head"][0], U["block"][0]
O_ALL = U["embed"][1] + U["head"][1] + L * U["block"][1]  # every unit's optimizer state
P_ALL = P_ENDS + L * P_B


def _expected(case: str) -> dict:
    """Bytes per kind of a steady step (``read_<kind>`` / ``written_<kind>``)."""
    updates = {"read_opt": O_ALL, "written_opt": O_ALL, "written_params": P_ALL}
    return {
        "backprop": {"read_params": P_ENDS + (2 * L - 1) * P_B, **updates},
        "forward_eager": {"read_params": P_ENDS + 2 * L * P_B, **updates},
        "forward_lazy": {"read_params": P_ENDS + L * P_B, **updates},
        "hybrid_eager": {"read_params": P_ENDS + (3 * L - 1) * P_B, **updates,
                         "read_scratch": P_ALL, "written_scratch": P_ALL},
        "hybrid_lazy": {"read_params": P_ENDS + (2 * L - 1) * P_B, **updates,
                        "read_carry": P_ALL, "written_carry": P_ALL},
    }[case]


def _pending_bytes(path) -> int:
    """Bytes of the committed ``extra["pending"]`` records as the manifest file spells them."""
    m = json.loads((path / "manifest.json").read_bytes())
    return len(json.dumps(m["extra"].get("pending", {}), sort_keys=True).encode())


def _check(m: dict, want: dict, path, manifest_before: int) -> None:
    for kind in ("params", "opt", "scratch", "carry"):
        for way in ("read", "written"):
            assert m[f"bytes_{way}_{kind}"] == want.get(f"{way}_{kind}", 0), (way, kind)
    assert m["bytes_read_manifest"] == manifest_before
    assert m["bytes_written_manifest"] == os.path.getsize(path / "manifest.json")
    assert m["bytes_written_pending"] == _pending_bytes(path)
    read = sum(want.get(f"read_{k}", 0) for k in ("params", "opt", "scratch", "carry"))
    written = sum(want.get(f"written_{k}", 0) for k in ("params", "opt", "scratch", "carry"))
    assert m["bytes_read"] == read + manifest_before
    assert m["bytes_written"] == written + os.path.getsize(path / "manifest.json")
    assert m["bytes_read_per_layer"] == pytest.approx(m["bytes_read"] / L)
    assert m["bytes_written_per_layer"] == pytest.approx(m["bytes_written"] / L)


@pytest.mark.parametrize("case, est, update", [
    ("backprop", jg.backprop(), "eager"), ("forward_eager", FORWARD, "eager"),
    ("forward_lazy", FORWARD, "lazy"), ("hybrid_eager", HYBRID, "eager"),
    ("hybrid_lazy", HYBRID, "lazy")])
def test_bytes_per_step_match_the_shapes(tmp_path, case, est, update):
    path = tmp_path / case
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=ADAM)
    ex = StreamedExecutor(STACK, est, ADAM, store,
                          StreamConfig(compute_dtype="float32", update=update))
    ex.step(_batch(0), jax.random.key(10))  # the first step: lazy records made, none applied
    for t in (1, 2):
        before = os.path.getsize(path / "manifest.json")
        _check(ex.step(_batch(t), jax.random.key(10 + t)), _expected(case), path, before)
    if update == "lazy":  # the records are in the manifest, and counted inside it
        m = ex.step(_batch(3), jax.random.key(13))
        assert 0 < m["bytes_written_pending"] < m["bytes_written_manifest"]


@pytest.mark.slow  # the composed engine's own compile; its bytes come from the same step
def test_composed_step_counts_bytes(tmp_path):
    """The composed engine (2 stages of 2 layers): its reverse sweep starts on the forward's
    last chunk, both of its layers still resident."""
    path = tmp_path / "c"
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=ADAM)
    ex = ComposedExecutor(STACK, HYBRID, ADAM, store, StreamConfig(compute_dtype="float32"),
                          mesh=make_mesh(1, 2))
    ex.step(_batch(0), jax.random.key(10))
    before = os.path.getsize(path / "manifest.json")
    want = {**_expected("hybrid_eager"), "read_params": P_ENDS + (3 * L - 2) * P_B}
    _check(ex.step(_batch(1), jax.random.key(11)), want, path, before)


def test_replayed_updates_write_a_layer_every_k_steps(tmp_path):
    """``rewrite_every=3``: every steady step reads each unit once; a unit (the embed and head
    too) is written only on the step whose read finds 3 records."""
    path = tmp_path / "k3"
    store = LayerStore.create(path, STACK.init(jax.random.key(0)), optimizer=ADAM)
    ex = StreamedExecutor(STACK, FORWARD, ADAM, store,
                          StreamConfig(compute_dtype="float32", update="lazy", rewrite_every=3))
    ex.step(_batch(0), jax.random.key(10))  # one record per unit, nothing replayed yet
    writes = []
    for t in range(1, 7):
        before = os.path.getsize(path / "manifest.json")
        m = ex.step(_batch(t), jax.random.key(10 + t))
        rewrite = t % 3 == 0  # the reads of steps 3 and 6 find 3 records
        writes.append(m["bytes_written_params"])
        _check(m, {"read_params": P_ALL, "read_opt": O_ALL,  # the replay needs Adam's state
                   "written_params": P_ALL if rewrite else 0,
                   "written_opt": O_ALL if rewrite else 0}, path, before)
        waiting = {len(v) for k, v in lazy.waiting(store.extra).items()}
        assert waiting == {1 if rewrite else t % 3 + 1}
    assert sum(writes) == 2 * P_ALL  # 1/3 of the writes
