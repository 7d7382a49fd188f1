"""The ``stream`` engine plugs into the experiment runner; its shipped config parses and runs."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
import yaml

import jaxstream.grad as jg
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.engine_stream import StreamEngine, StreamEngineConfig
from jaxstream.experiment.runner import load_experiment, run_experiment
from jaxstream.models import mlp
from jaxstream.stream.store import LayerStore

CONFIGS = sorted(Path(__file__).resolve().parents[2].glob("experiments/stream_*.yaml"))


def test_configs_parse():
    assert CONFIGS
    for path in CONFIGS:
        kind, cfg = load_experiment(path)
        assert kind == "train" and type(cfg.engine) is StreamEngineConfig


def test_bad_engine_option_is_named():
    with pytest.raises((ConfigError, ValueError), match="engine.*compute_dtype|compute_dtype"):
        load_experiment(CONFIGS[0], ["engine.compute_dtype=int8"])
    with pytest.raises((ConfigError, ValueError), match="rewrite_every.*needs update: lazy"):
        load_experiment(CONFIGS[0], ["engine.update=eager", "engine.rewrite_every=3"])


@pytest.mark.standard_promotion  # steps optax itself
def test_stream_engine_matches_local_engine(tmp_path):
    """Same config, same keys: the streamed steps give the local engine's parameters."""
    stack = mlp(8, 8, 3, 4)
    params = stack.init(jax.random.key(0))
    opt = optax.adam(1e-2)
    est = jg.forward(num_tangents=2)
    cfg = StreamEngineConfig(store=str(tmp_path / "{arm}"), micro_batches=2, update="lazy",
                             rewrite_every=2)  # the layers are written back at the third step
    eng = StreamEngine(cfg, stack=stack, estimator=est, optimizer=opt)
    state = eng.init(params, jax.random.key(1))
    p, s = params, opt.init(params)

    @jax.jit  # the in-memory step (one compile, not op by op)
    def local_step(p, s, batch, key):
        loss, g = est(stack, p, batch, key)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    rng = np.random.default_rng(0)
    batches = [{"x": rng.standard_normal((6, 8), dtype=np.float32), "y": rng.integers(0, 4, 6)}
               for _ in range(3)]
    # the warm-up compiles without writing: the steps after it are the local engine's
    eng.warm_up(state, batches[0], jax.random.key(0))
    assert eng.executor.store.step == 0 and not any(eng.executor.pending.records.values())
    for t, batch in enumerate(batches):
        key = jax.random.key(t)
        state, metrics = eng.step(state, batch, key)
        p, s, loss = local_step(p, s, batch, key)
        assert abs(metrics["loss"] - float(loss)) <= 1e-6 * abs(float(loss))
    got = eng.params(state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # reopening (a resumed run) continues from the store's step: committed steps are not redone
    again = StreamEngine(cfg, stack=stack, estimator=est, optimizer=opt)
    st = again.init(params, jax.random.key(1))
    st, start = again.resume_at(st, 0, run_dir=tmp_path, resume=True)
    assert int(st.step) == start == 3


def test_run_experiment_end_to_end(tmp_path, monkeypatch):
    # The shipped config with its backprop arm (micro-batches from engine.micro_batches) and its
    # hybrid arm (micro-batches of its own); the forward arm goes through the same engine path
    # as backprop and is checked against the local engine above.
    data = yaml.safe_load(CONFIGS[0].read_text())
    data["arms"] = [a for a in data["arms"] if a["estimator"]["type"] in ("backprop", "hybrid")]
    assert len(data["arms"]) == 2
    config = tmp_path / CONFIGS[0].name
    config.write_text(yaml.safe_dump(data))
    # commits land on a thread (async_commit, the default), slowly here: each checkpoint must
    # still find its step on disk (the runner settles the store first)
    import jaxstream.stream.store_commit as store_mod
    from jaxstream.experiment.checkpoints import ArmCheckpointer

    write = store_mod.write_manifest
    monkeypatch.setattr(store_mod, "write_manifest",
                        lambda *a, **k: (time.sleep(0.3), write(*a, **k))[1])
    save, on_disk = ArmCheckpointer.save, []

    def checked_save(self, step, state, meta=None):
        on_disk.append((step, {a: LayerStore.open(tmp_path / "stores" / a).step
                               for a in ("backprop", "hybrid")
                               if (tmp_path / "stores" / a / "manifest.json").exists()}))
        return save(self, step, state, meta)

    monkeypatch.setattr(ArmCheckpointer, "save", checked_save)
    _, summary = run_experiment(
        config, ["steps=3", "eval_every=3", "checkpoint_every=2", "plots=false",
                 "progress=false", "model.depth=2", f"engine.store={tmp_path}/stores/{{arm}}"],
        out=tmp_path / "run")
    assert summary["finished"] and set(summary["arms"]) == {"backprop", "hybrid"}
    # compilation is timed before the step clock (it used to be 0.0 and inside step 1)
    assert all(a["compile_time"] > 0.0 for a in summary["arms"].values())
    assert all(np.isfinite(a["final_test_loss"]) if "final_test_loss" in a else True
               for a in summary["arms"].values())
    # each arm trained from its own store, committed at the last step
    for arm in ("backprop", "hybrid"):
        assert LayerStore.open(tmp_path / "stores" / arm).step == 3
    # checkpoints at steps 2 and 3 of each arm; the arm training has its store on disk there
    assert [s for s, _ in on_disk] == [2, 3, 2, 3]
    assert [d["backprop"] for _, d in on_disk[:2]] == [2, 3]
    assert [d["hybrid"] for _, d in on_disk[2:]] == [2, 3]
