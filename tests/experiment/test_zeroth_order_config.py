"""``estimator: {type: spsa, ...}`` and ``{type: forward, rank: r}`` in a config: built as the
library builds them, bad values refused with one line naming the field, engines that cannot run
the zeroth-order pass refused when the config loads (nothing written), and the local engine's
estimate the estimator's own."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

import jaxstream.grad as jg
from jaxstream.experiment.config import ConfigError, from_dict, load_config
from jaxstream.experiment.engines import build_engine
from jaxstream.experiment.estimators import EstimatorConfig
from jaxstream.experiment.runner import run_experiment
from jaxstream.experiment.train_config import TrainConfig
from jaxstream.models import mlp

ROOT = Path(__file__).resolve().parents[2]
EXP = ROOT / "experiments"


def test_sections_build_the_library_estimators():
    cfg = from_dict(EstimatorConfig, yaml.safe_load(
        "type: spsa\nnum_directions: 3\neps: 0.01\ndistribution: gaussian\nrank: 2"))
    assert cfg.build() == jg.spsa(3, 1e-2, "gaussian", rank=2)
    assert cfg.describe() == "spsa(K=3, eps=0.01, rank 2)"
    assert from_dict(EstimatorConfig, {"type": "spsa"}).build() == jg.spsa()
    cfg = from_dict(EstimatorConfig, {"type": "forward", "num_tangents": 2, "rank": 3})
    assert cfg.build() == jg.forward(2, rank=3)
    assert cfg.describe() == "forward(weights, K=2, rank 3)"


@pytest.mark.parametrize("section, match", [
    ({"type": "spsa", "eps": 0}, r"eps: must be > 0, got 0"),
    ({"type": "spsa", "eps": -0.1}, r"eps: must be > 0, got -0.1"),
    ({"type": "spsa", "rank": 0}, r"rank: must be >= 1 or null, got 0"),
    ({"type": "spsa", "num_directions": 0}, r"num_directions: must be >= 1, got 0"),
    ({"type": "spsa", "distribution": "uniform"},
     r"distribution: 'uniform' is not allowed; choose one of 'rademacher', 'gaussian'"),
    ({"type": "forward", "rank": 2, "perturb": "activations"},
     r"rank=2: low-rank tangents are for weight matrices; allowed: perturb='weights'"),
    ({"type": "forward", "rank": 0}, r"rank: must be >= 1 or null, got 0"),
])
def test_bad_values_are_one_line_naming_the_field(section, match):
    with pytest.raises(ConfigError, match=match) as err:
        from_dict(EstimatorConfig, section)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("config, overrides, match", [
    (EXP / "stream_mlp.yaml", ["arms.1.estimator={type: spsa}"],
     r"arms.1.estimator: stream: spsa\(K=1\) needs a 'zeroth_order' forward pass"),
    (EXP / "pipeline_mlp.yaml", ["arms.0.estimator={type: spsa, num_directions: 2}"],
     r"arms.0.estimator: pipeline: spsa\(K=2\) needs a 'zeroth_order' forward pass"),
    (EXP / "quickstart.yaml", ["arms.0.estimator={type: spsa, eps: 0}"],
     r"arms.0.estimator.eps: must be > 0"),
])
def test_engines_without_the_pass_refuse_it_before_anything_is_written(tmp_path, config,
                                                                      overrides, match):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=match):
        run_experiment(config, overrides, out=out)
    assert not out.exists()


@pytest.mark.parametrize("section", [{"type": "spsa", "num_directions": 2, "eps": 0.01},
                                     {"type": "forward", "rank": 2}])
def test_local_engine_estimate_is_the_estimators(section):
    stack = mlp(in_dim=6, width=5, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, size=8), jnp.int32)}
    est = from_dict(EstimatorConfig, section).build()
    engine = build_engine(load_config(TrainConfig).engine, stack=stack, estimator=est,
                          optimizer=optax.sgd(0.1), micro_batches=1)
    key = jax.random.key(3)
    loss, g = engine.estimate(engine.init(params, None), batch, key)
    ref_loss, ref = jax.jit(lambda p: est(stack, p, batch, key))(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
