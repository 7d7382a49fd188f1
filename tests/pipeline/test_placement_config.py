"""Placement in a run: seed 001's assignment by layer type against exhaustive enumeration and
against ``place_by_type``; ``engine.placement`` checked by name when the config loads; the
pipeline engine over unequal stages against the in-memory estimators."""

from __future__ import annotations

import itertools
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.engine_pipeline import PipelineEngine, PipelineEngineConfig
from jaxstream.experiment.engines import split_micro_batches
from jaxstream.experiment.placement_config import PlacementConfig
from jaxstream.experiment.registry import load_experiment
from jaxstream.experiment.runner import run_experiment
from jaxstream.models import mlp
from jaxstream.pipeline import unequal_stages
from jaxstream.placement import assign_by_type, measure_kind_speeds, place_by_type, place_stages

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "pipeline_by_type.yaml"


def brute_by_type(types, work, kinds, type_kind, rate) -> float:
    """Least slowest-device time over every map of layers to devices of their type's kind in
    which each device gets a layer and, within a kind, devices take the kind's layers in
    device order (enumerated, then filtered)."""
    options = [[s for s, k in enumerate(kinds) if k == type_kind[t]] for t in types]
    best = np.inf
    for stage_of in itertools.product(*options):
        if set(stage_of) != set(range(len(kinds))):
            continue
        if any(list(seq) != sorted(seq) for seq in
               ([s for s in stage_of if kinds[s] == k] for k in set(kinds))):
            continue
        load = [sum(work[l] / rate[(kinds[s], types[l])] for l in range(len(types))
                    if stage_of[l] == s) for s in range(len(kinds))]
        best = min(best, max(load))
    return best


def brute_contiguous(types, work, kinds, rate) -> float:
    """Least slowest-stage time over every cut of the layers into len(kinds) consecutive runs."""
    n, m, best = len(types), len(kinds), np.inf
    for cuts in itertools.combinations(range(1, n), m - 1):
        b = (0, *cuts, n)
        best = min(best, max(sum(work[l] / rate[(kinds[s], types[l])] for l in range(b[s], b[s + 1]))
                             for s in range(m)))
    return best


def test_assignment_by_type_is_the_best_of_its_kind():
    """Random small models (up to 8 layers, 3 types, up to 4 devices of 2 kinds): the seed's
    assignment's slowest device equals exhaustive enumeration, and its device times add up."""
    rng = np.random.default_rng(1)
    types_all, checked = ("dense", "conv", "act"), 0
    for _ in range(80):
        n, m = int(rng.integers(2, 9)), int(rng.integers(2, 5))
        kinds = [str(k) for k in rng.choice(["gpu", "cpu"], m)]
        type_kind = {t: str(rng.choice(sorted(set(kinds)))) for t in types_all}
        types = [str(t) for t in rng.choice(types_all, n)]
        work = rng.uniform(0.1, 5.0, n)
        rate = {(k, t): float(rng.uniform(0.5, 4.0)) for k in ("gpu", "cpu") for t in types_all}
        want = brute_by_type(types, work, kinds, type_kind, rate)
        if not np.isfinite(want):  # some device gets no layer: refused by name
            with pytest.raises(ValueError, match=r"device kind '\w+': \d+ devices but"):
                assign_by_type(types, work, kinds, type_kind, rate)
            continue
        got = assign_by_type(types, work, kinds, type_kind, rate)
        assert got.slowest == pytest.approx(want, rel=1e-12)
        for s in range(m):
            mine = [l for l in range(n) if got.stage_of[l] == s]
            assert all(kinds[s] == type_kind[types[l]] for l in mine)
            assert got.stage_times[s] == pytest.approx(
                sum(work[l] / rate[(kinds[s], types[l])] for l in mine))
        ordered = list(got.stage_of) == sorted(got.stage_of)
        assert (got.sizes is not None) == ordered
        checked += 1
    assert checked > 20


def test_alternating_dense_activation_seed_against_place_by_type(capsys):
    """16 alternating dense / activation layers, one "gpu" and one "cpu" device (gpu twice as
    fast on dense, a quarter as fast on activations; an activation twice a dense layer's
    work): the seed's assignment costs one device's share of its type, below the best
    consecutive split, both checked by enumeration."""
    types = ["dense", "act"] * 8
    work = [1.0 if t == "dense" else 2.0 for t in types]
    rate = {("gpu", "dense"): 2.0, ("gpu", "act"): 0.5, ("cpu", "dense"): 1.0,
            ("cpu", "act"): 2.0}
    kinds, type_kind = ["gpu", "cpu"], {"dense": "gpu", "act": "cpu"}
    seed = assign_by_type(types, work, kinds, type_kind, rate)
    blocks = place_by_type(types, work, kinds, rate)
    assert seed.slowest == pytest.approx(max(8 * 1.0 / 2.0, 8 * 2.0 / 2.0))  # each kind's share
    assert seed.slowest == pytest.approx(brute_by_type(types, work, kinds, type_kind, rate))
    assert blocks.slowest == pytest.approx(brute_contiguous(types, work, kinds, rate))
    assert seed.slowest < blocks.slowest and seed.sizes is None  # alternates between devices
    with capsys.disabled():
        print(f"\n16 alternating layers: seed assignment {seed.slowest}, place_by_type "
              f"{blocks.slowest} (sizes {blocks.sizes})")


def test_kind_speeds_are_measured_per_kind():
    """One speed per kind, on the first device of that kind; too few devices are refused."""
    x = np.ones((16, 16), np.float32)
    speeds = measure_kind_speeds(lambda a: a @ a, (x,), ["gpu", "cpu", "gpu"], repeats=2)
    assert list(speeds) == ["gpu", "cpu"]
    assert all(np.isfinite(v) and v > 0 for v in speeds.values())
    with pytest.raises(ValueError, match="devices: 1 for 2 stages"):
        measure_kind_speeds(lambda a: a, (x,), ["gpu", "cpu"], jax.devices()[:1])


@pytest.mark.parametrize("overrides, match", [
    (["engine.placement.kind=spread"],
     r"engine.placement.kind: 'spread' is not allowed; choose one of 'equal', 'by_speed'"),
    (["engine.placement={kind: by_speed}"],
     r"engine.placement.speeds: missing; placement kind 'by_speed' needs speeds"),
    (["engine.placement={kind: by_speed, speeds: [1, 2]}"],
     r"engine.placement.speeds: one speed per stage, 3 \(engine.stages\); got 2"),
    (["engine.placement={kind: by_speed, speeds: [1, 2, -1]}"],
     r"engine.placement.speeds.2: must be > 0"),
    (["engine.placement={kind: equal}"],
     r"engine.stages: 3 must divide model.depth = 7 .*by_speed or by_type"),
    (["engine.stages=8", "engine.placement={kind: by_speed, speeds: [1, 1, 1, 1, 1, 1, 1, 1]}"],
     r"engine.stages: 8 stages for model.depth = 7 blocks; every stage needs a block"),
    (["model.depth=6"], r"engine.placement.layer_types: one type per block, 6 \(model.depth\)"),
    (["engine.placement.speeds={gpu: 2.0}"],
     r"engine.placement.speeds: no speed for device kind 'cpu' \(of type 'act'\)"),
    (["engine.placement.devices=[gpu, cpu, gpu]"],
     (r"engine.placement: by_type puts blocks on stages \[0, 0, [02], 2, 2, 1, 1\]; the "
      r"pipeline runs each stage's blocks as one consecutive run")),
    (["engine.placement.devices=[gpu, gpu, gpu]"],
     r"engine.placement: type_kind\['act'\]: 'cpu' is not among the device kinds"),
    (["engine.placement.layer_types=[dense, dense, dense, dense, dense, dense, act]",
      "engine.placement.devices=[gpu, cpu, cpu]"],
     r"engine.placement: device kind 'cpu': 2 devices but 1 layers"),
])
def test_bad_placement_is_refused_by_name_before_anything_is_written(tmp_path, overrides, match):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=match) as err:
        run_experiment(CONFIG, overrides, out=out)
    assert "\n" not in str(err.value) and not out.exists()


def test_placement_kinds_give_stage_sizes():
    assert PlacementConfig().sizes(8, 4) == (2, 2, 2, 2)
    assert PlacementConfig("by_speed", speeds=(1.0, 1.0, 2.0, 4.0)).sizes(16, 4) == (2, 2, 4, 8)
    _, cfg = load_experiment(CONFIG)
    sizes = cfg.engine.placement.sizes(cfg.model.depth, cfg.engine.stages)
    assert sum(sizes) == cfg.model.depth and len(set(sizes)) > 1  # the shipped one is unequal
    _, cfg = load_experiment(CONFIG, ["engine.placement={kind: by_speed, speeds: [1, 1, 2]}"])
    assert cfg.engine.placement.sizes(7, 3) == place_stages(np.ones(7), (1, 1, 2)).sizes
    with pytest.raises(ValueError, match="devices: not used by placement kind 'by_speed'"):
        PlacementConfig("by_speed", speeds=(1.0,), devices=("gpu",))


BY_TYPE = load_experiment(CONFIG)[1].engine.placement  # the shipped config's placement
STACK = mlp(in_dim=5, width=6, depth=len(BY_TYPE.layer_types), num_classes=3)


def _engine(estimator, n=4):
    cfg = PipelineEngineConfig(stages=len(BY_TYPE.devices), micro_batches=n, placement=BY_TYPE)
    return PipelineEngine(cfg, stack=STACK, estimator=estimator, optimizer=optax.sgd(0.1),
                          micro_batches=n)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((8, 5)).astype(np.float32),
             "y": rng.integers(0, 3, (8,)).astype(np.int32)}
    return STACK.init(jax.random.key(0)), batch


def test_by_type_pipeline_backprop_is_the_sequential_gradient(problem):
    """One SGD step of the engine over unequal stages is the step along ``jax.grad`` of the
    sequential model, and the state keeps the model's shapes."""
    params, batch = problem
    eng = _engine(jg.backprop())
    assert len(set(eng.sizes)) > 1
    new, metrics = eng.step(eng.init(params, jax.random.key(0)), batch, jax.random.key(1))
    ref_loss, ref = jax.value_and_grad(STACK)(params, batch)
    assert abs(float(metrics["loss"] - ref_loss)) <= 1e-5
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, ref)
    assert jax.tree.structure(eng.params(new)) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 eng.params(new), want)


def test_by_type_pipeline_forward_is_the_padded_models_estimator(problem):
    """Tangents are drawn per padded block: the in-memory forward estimator of the padded
    model, per micro-batch key, mean over micro-batches, cut back to the model's blocks."""
    params, batch = problem
    est = jg.forward(2, "gaussian")
    eng = _engine(est)
    key = jax.random.key(3)
    _, grads = eng.estimate(eng.init(params, jax.random.key(0)), batch, key)
    padded, pad, unpad = unequal_stages(STACK, eng.sizes)
    micro = split_micro_batches(batch, 4)
    one = jax.jit(lambda b, k: est(padded, pad(params), b, k)[1])
    ref = [one(jax.tree.map(lambda a, n=n: a[n], micro), jax.random.fold_in(key, n))
           for n in range(4)]
    ref = unpad(jax.tree.map(lambda *a: sum(a) / 4, *ref))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grads, ref)


def test_shipped_by_type_config_runs(tmp_path):
    out = tmp_path / "run"
    run_experiment(CONFIG, ["steps=2", "eval_every=2", "diag_every=0", "checkpoint_every=0",
                            "arms=[{name: backprop, estimator: {type: backprop}, lr: 0.003}]"],
                   out=out)
    assert (out / "summary.json").is_file()
