"""A diverging run leaves a sane state: the layer store keeps the last commit that passed its
divergence guard (finite parameters and loss, parameter norm at most 10x the last sane
commit's), refuses to write past a commit that failed it, and ``--rollback`` continues from
the sane commit, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from jaxstream.cli import main as cli_main
from jaxstream.experiment.runner import run_experiment
from jaxstream.stream import LayerStore
from jaxstream.stream.errors import StoreDivergedError
from jaxstream.stream.guard import GROWTH

ROOT = Path(__file__).resolve().parents[2]
STREAM = ROOT / "experiments" / "stream_mlp.yaml"


def _params(layers=2, width=4):
    r = np.random.default_rng(0)
    return {"embed": {"w": r.standard_normal((5, width), dtype=np.float32)},
            "blocks": {"w": r.standard_normal((layers, width, width), dtype=np.float32)},
            "head": {"w": r.standard_normal((width, 2), dtype=np.float32)}}


def _norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(x, dtype=np.float64))
                             for x in jax.tree.leaves(tree))))


def _equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_the_store_keeps_its_last_sane_commit(tmp_path):
    adam = optax.adam(1e-3)
    p = _params()
    store = LayerStore.create(str(tmp_path / "s"), p, optimizer=adam)
    base = _norm(p)
    # Layer 0 scaled so that the whole norm grows just under the bound: sane.
    w0 = p["blocks"]["w"][0]
    rest = base ** 2 - float(np.sum(np.square(w0, dtype=np.float64)))
    k = np.sqrt(((0.99 * GROWTH * base) ** 2 - rest) / np.sum(np.square(w0, dtype=np.float64)))
    store.write(0, {"w": (w0 * k).astype(np.float32)})
    store.commit(1)
    assert store.sane_step == 1
    sane = store.read_params()
    assert _norm(sane) == pytest.approx(0.99 * GROWTH * base, rel=1e-5)
    store.write(1, {"w": np.full((4, 4), 1e37, np.float32)})  # finite, exploded
    store.commit(2)
    assert (store.step, store.sane_step) == (2, 1)
    with pytest.raises(StoreDivergedError, match=r"step 2 failed the divergence guard .*norm "
                                                 r"4e\+37 exceeds 10x .* step 1, is kept.*"
                                                 r"--rollback"):
        store.write(0, {"w": p["blocks"]["w"][0]})
    again = LayerStore.open(str(tmp_path / "s"), optimizer=adam)  # the record is committed
    assert again.sane_step == 1 and again.rollback_to_sane() == 1
    assert _equal(again.read_params(), sane) and np.isfinite(_norm(again.read_params()))
    # Trains on from there; a step whose loss was not finite fails the guard too.
    again.write(1, {"w": p["blocks"]["w"][1]})
    again.commit(2, extra={"loss_finite": False})
    assert again.sane_step == 1
    with pytest.raises(StoreDivergedError, match="the step's loss was not finite"):
        again.write(1, {"w": p["blocks"]["w"][1]})


def _arm(lr: float) -> str:
    return f"arms=[{{name: bp, estimator: {{type: backprop}}, lr: {lr}}}]"


TINY = ["steps=6", "eval_every=3", "diag_every=0", "checkpoint_every=2", "model.width=8",
        "model.depth=2", "batch_size=16", "plots=false", "progress=false", "optimizer.name=sgd"]


@pytest.mark.slow
def test_rollback_resumes_a_diverged_streamed_run_from_its_last_sane_commit(tmp_path, capsys):
    """The attack: sgd at lr 2e38 on a streamed run. Step 1's commit holds parameters near
    1e37 and fails the guard, the run stops as diverged. ``--rollback`` at lr 0.1 (a rollback
    may change the lr; it is recorded) continues from step 0, the last sane commit; stopped by ``max_steps``, the run then finishes with
    ``--resume`` (``--rollback`` is refused on a run that has not diverged)."""
    out = tmp_path / "run"
    _, summary = run_experiment(STREAM, [*TINY, _arm(2e38)], out=out)
    assert summary["arms"]["bp"]["diverged"]
    store = LayerStore.open(str(out / "stores" / "bp"))
    assert (store.step, store.sane_step) == (1, 0)
    assert max(float(np.abs(x).max()) for x in jax.tree.leaves(store.read_params())) > 1e30
    store.close()
    args = ["run", str(STREAM), *TINY, _arm(0.1), "--out", str(out)]
    assert cli_main([*args, "--rollback", "max_steps=3"]) == 0
    store = LayerStore.open(str(out / "stores" / "bp"))
    assert store.step == 3 and store.sane_step == 3
    store.close()
    assert cli_main([*args, "--rollback"]) == 2  # nothing diverged any more
    assert cli_main([*args, "--resume"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] and not summary["arms"]["bp"]["diverged"]
    records = list(map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]  # step 1 replaced
    assert any(r.get("rollback") and r["lr"] == 0.1 for r in records)
    capsys.readouterr()


def test_a_store_allocated_with_zeros_takes_its_first_weights(tmp_path):
    """No growth bound from an all-zero allocation: layer-by-layer initialisation commits."""
    p = _params()
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p)
    store = LayerStore.create(str(tmp_path / "s"), shapes, optimizer=optax.adam(1e-3))
    big = jax.tree.map(lambda x: x * 100, p)
    for l in range(2):
        store.write(l, {"w": big["blocks"]["w"][l]})
        store.commit(l + 1)
        assert store.sane_step == l + 1
    assert _equal(store.read_params()["blocks"], big["blocks"])


def test_a_diverged_store_handed_to_a_new_run_is_refused_until_rolled_back(tmp_path, capsys):
    """``engine.continue_store`` onto a store whose last commit failed the guard: refused by
    name before any step (exit 2, the way back named, the store untouched); rolled back
    (``LayerStore.rollback_to_sane``) it trains on."""
    store = tmp_path / "stores" / "{arm}"
    cut = [*TINY[:1], "max_steps=2", *TINY[1:]]
    _, summary = run_experiment(STREAM, [*cut, _arm(2e38), f"engine.store={store}"],
                                out=tmp_path / "a")
    assert summary["arms"]["bp"]["diverged"]
    path = str(tmp_path / "stores" / "bp")
    manifest = (tmp_path / "stores" / "bp" / "manifest.json").read_bytes()
    args = ["run", str(STREAM), *cut, _arm(0.1), f"engine.store={store}",
            "engine.continue_store=true", "--out", str(tmp_path / "b")]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "failed the divergence guard" in err and "rollback_to_sane()" in err, err
    assert (tmp_path / "stores" / "bp" / "manifest.json").read_bytes() == manifest
    s = LayerStore.open(path)
    assert s.rollback_to_sane() == 0
    s.close()
    assert cli_main([*args[:-1], str(tmp_path / "c")]) == 0
    s = LayerStore.open(path)
    assert s.step == s.sane_step == 2
