"""Runs of the ``stream`` engine never lie: resume from the store's step, one store per arm,
stores inside the run directory, non-finite parameters never committed, time fields named."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.rundir import MetricsLog, strip_time_fields
from jaxstream.experiment.runner import run_experiment
from jaxstream.stream.errors import StoreMismatchError
from jaxstream.stream.store import LayerStore

TINY = {"kind": "train", "seed": 0, "steps": 6, "batch_size": 16, "eval_every": 2,
        "diag_every": 0, "checkpoint_every": 0, "plots": False, "progress": False,
        "model": {"type": "mlp", "width": 8, "depth": 2},
        "data": {"type": "digits", "test_fraction": 0.2},
        "engine": {"type": "stream", "store": None, "prefetch": 1, "micro_batches": 2},
        "arms": [{"name": "fwd", "estimator": {"type": "forward", "num_tangents": 2}, "lr": 0.01}]}


def _config(tmp_path: Path, **changes) -> Path:
    data = json.loads(json.dumps(TINY))
    for k, v in changes.items():
        node, *rest = k.split(".")
        if rest:
            data[node][rest[0]] = v
        else:
            data[k] = v
    path = tmp_path / f"cfg{len(list(tmp_path.glob('cfg*')))}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _records(run_dir: Path) -> list[dict]:
    return [strip_time_fields(r) for r in MetricsLog(run_dir / "metrics.jsonl").read()]


def _temp_stores() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("jaxstream-store-")}


def test_store_ahead_of_checkpoint_resumes_from_the_store(tmp_path):
    """Cases 1, 10, 11, 13: a run killed after step 4 with no checkpoint (checkpoint_every=0)
    and its last log line lost resumes at the store's step 4; steps 5-6 and the evaluation at 6
    equal an uninterrupted run's; step 4 is marked lost, never NaN-diverged; the store of
    ``store: null`` lives in the run directory; reruns differ only in time fields."""
    before = _temp_stores()
    cfg = _config(tmp_path)
    full, s_full = run_experiment(cfg, out=tmp_path / "full")
    assert (full / "stores" / "fwd" / "manifest.json").exists() and _temp_stores() == before
    part, _ = run_experiment(cfg, ["max_steps=4"], out=tmp_path / "part")
    shutil.rmtree(part / "checkpoints")  # killed before any checkpoint was written ...
    log = MetricsLog(part / "metrics.jsonl")
    log.rewrite([r for r in log.read() if r["step"] != 4])  # ... and before step 4 was logged
    assert LayerStore.open(part / "stores" / "fwd").step == 4
    _, s_res = run_experiment(cfg, out=tmp_path / "part", resume=True)
    got, want = _records(part), _records(full)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert got[4] == {"arm": "fwd", "step": 4, "lost": True}
    assert got[:4] + got[5:] == want[:4] + want[5:]
    assert "layers_read" in got[5] and "stall_time" in MetricsLog(part / "metrics.jsonl").read()[5]
    assert not s_res["arms"]["fwd"]["diverged"] and s_res["finished"]
    assert s_res["arms"]["fwd"]["lost_steps"] == [4]
    assert s_res["arms"]["fwd"]["final_test_accuracy"] == s_full["arms"]["fwd"]["final_test_accuracy"]
    # an identical rerun: identical records once the named time fields are left out
    again, _ = run_experiment(cfg, out=tmp_path / "again")
    assert _records(again) == want


def test_new_run_refuses_an_existing_store(tmp_path):
    """Case 2: a new run whose engine.store holds a store is refused before anything is written."""
    store = tmp_path / "stores" / "fwd"
    run_experiment(_config(tmp_path, steps=2), [f"engine.store={tmp_path}/stores/{{arm}}"],
                             out=tmp_path / "first")
    assert LayerStore.open(store).step == 2
    with pytest.raises(ConfigError, match=r"engine.store: a layer store already exists .*--resume"):
        run_experiment(_config(tmp_path, steps=2), [f"engine.store={tmp_path}/stores/{{arm}}"],
                       out=tmp_path / "second")
    assert not (tmp_path / "second").exists()
    # told to continue it: trains on from the store's step
    _, s = run_experiment(_config(tmp_path, steps=4), [f"engine.store={tmp_path}/stores/{{arm}}",
                                                       "engine.continue_store=true"],
                          out=tmp_path / "third")
    assert LayerStore.open(store).step == 4 and s["arms"]["fwd"]["steps"] == 4


def test_arms_never_share_a_store(tmp_path):
    """Case 3: several arms and a store path without {arm} are refused when the config loads;
    a store records its arm, so another arm cannot open it."""
    arms = [{"name": "a", "estimator": {"type": "backprop"}, "lr": 0.01},
            {"name": "b", "estimator": {"type": "backprop"}, "lr": 0.01}]
    cfg = _config(tmp_path, arms=arms)
    with pytest.raises(ConfigError, match=r"engine.store: .* shared by the arms a, b; put \{arm\}"):
        run_experiment(cfg, [f"engine.store={tmp_path}/one"], out=tmp_path / "r")
    assert not (tmp_path / "r").exists()
    import jax
    import optax

    import jaxstream.grad as jg
    from jaxstream.experiment.engine_stream import StreamEngine, StreamEngineConfig
    from jaxstream.models import mlp

    stack = mlp(4, 4, 1, 2)
    ecfg = StreamEngineConfig(store=str(tmp_path / "s"))
    arm = lambda n: type("Arm", (), {"name": n})()
    a = StreamEngine(ecfg, stack=stack, estimator=jg.backprop(), optimizer=optax.sgd(0.1), arm=arm("a"))
    a.init(stack.init(jax.random.key(0)), None)
    a.params(a.init(stack.init(jax.random.key(0)), None))  # creates the store of arm a
    b = StreamEngine(ecfg, stack=stack, estimator=jg.backprop(), optimizer=optax.sgd(0.1), arm=arm("b"))
    b.init(stack.init(jax.random.key(0)), None)
    with pytest.raises(StoreMismatchError, match="'arm' is 'a' in the store but 'b'"):
        b.params(None)


def test_diverging_run_keeps_its_last_finite_commit(tmp_path):
    """Case 12: a step that would commit non-finite parameters commits nothing, one whose
    commit fails the divergence guard (its norm jumped) is not the sane commit; either stops
    the run with diverged: true, and the store's last sane step is the one before."""
    arms = [{"name": "fwd", "estimator": {"type": "backprop"}, "lr": 1e38}]
    run, s = run_experiment(_config(tmp_path, arms=arms, steps=4), out=tmp_path / "r")
    assert s["arms"]["fwd"]["diverged"]
    store = LayerStore.open(run / "stores" / "fwd")
    last = [r for r in MetricsLog(run / "metrics.jsonl").read() if r["step"] > 0]
    assert last[-1].get("guard_failed") or not np.isfinite(last[-1]["loss"])
    assert store.sane_step == len(last) - 1  # the diverged step is not the sane one
    assert all(np.isfinite(x).all() for x in jax_leaves(store.read_params()))
    assert store.rollback_to_sane() == len(last) - 1


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)
