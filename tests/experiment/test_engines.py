"""The local engine against a hand-written optax step; micro-batch splitting; registries."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxstream.experiment import config as config_mod
from jaxstream.experiment import engines as engines_mod
from jaxstream.experiment import optimizers as optimizers_mod
from jaxstream.experiment.config import ConfigError, load_config
from jaxstream.experiment.engines import (
    EngineConfig,
    build_engine,
    engine_names,
    register_engine,
    split_micro_batches,
)
from jaxstream.experiment.estimators import BackpropConfig, HybridConfig
from jaxstream.experiment.optimizers import (
    OptimizerConfig,
    build_optimizer,
    optimizer_names,
    register_optimizer,
)
from jaxstream.experiment.train_config import TrainConfig
from jaxstream.models import mlp


def _problem():
    stack = mlp(in_dim=6, width=5, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, 3, size=8), jnp.int32)}
    return stack, params, batch


@pytest.mark.standard_promotion  # steps optax.adam itself
def test_local_engine_backprop_matches_manual_optax_step():
    stack, params, batch = _problem()
    tx = build_optimizer(OptimizerConfig(name="adam"), 0.01)
    engine = build_engine(load_config(TrainConfig).engine, stack=stack,
                          estimator=BackpropConfig().build(), optimizer=tx, micro_batches=1)
    state = engine.init(params, jax.random.key(1))

    @jax.jit  # the hand-written step (jitted, as the engine's is: one compile, not op by op)
    def manual_step(p, opt_state):
        loss, g = jax.value_and_grad(stack)(p, batch)
        upd, opt_state = optax.adam(0.01).update(g, opt_state, p)
        return optax.apply_updates(p, upd), opt_state, loss

    ref_params, ref_opt = params, optax.adam(0.01).init(params)
    for s in range(3):
        state, metrics = engine.step(state, batch, jax.random.key(s))
        ref_params, ref_opt, loss = manual_step(ref_params, ref_opt)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    chex.assert_trees_all_close(engine.params(state), ref_params, rtol=1e-5, atol=1e-7)


def test_hybrid_with_every_micro_batch_exact_equals_backprop_through_the_engine():
    stack, params, batch = _problem()
    est = HybridConfig(micro_batches=4, num_exact=4, correction="replace").build()
    tx = optax.sgd(0.1)
    hy = build_engine(load_config(TrainConfig).engine, stack=stack, estimator=est, optimizer=tx,
                      micro_batches=4)
    _, g = hy.estimate(hy.init(params, None), batch, jax.random.key(0))
    chex.assert_trees_all_close(g, jax.jit(jax.grad(stack))(params, batch), rtol=1e-5, atol=1e-6)


def test_split_micro_batches():
    b = {"x": jnp.arange(12.0).reshape(6, 2), "y": jnp.arange(6)}
    s = split_micro_batches(b, 3)
    assert s["x"].shape == (3, 2, 2) and s["y"].tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="not divisible"):
        split_micro_batches(b, 4)


@pytest.mark.parametrize("form", ["decorator", "call"])
def test_registered_optimizer_and_engine_are_usable_by_name(form):
    """Both forms of a registration: the decorator (the shape of every registration) and the
    older call with the object."""

    @dataclasses.dataclass(frozen=True)
    class EchoEngineConfig(EngineConfig):
        tag: str = "a"

        def build(self, **kw):
            return ("built", self.tag, kw)

    def factory(learning_rate, momentum=0.5):
        return optax.sgd(learning_rate, momentum=momentum)

    with pytest.raises(TypeError, match="the config class must subclass"):
        register_engine("test_plain", dataclasses.make_dataclass("Plain", []), lambda cfg, **kw: 0)
    with pytest.raises(TypeError, match="test_bare.*has no build method"):
        register_engine("test_bare")(dataclasses.dataclass(frozen=True)(
            type("Bare", (EngineConfig,), {})))
    assert "test_bare" not in engine_names()
    if form == "decorator":
        assert register_optimizer("test_sgd_momentum")(factory) is factory
        assert register_engine("test_echo")(EchoEngineConfig) is EchoEngineConfig
    else:
        register_optimizer("test_sgd_momentum", factory)
        register_engine("test_echo", EchoEngineConfig, lambda cfg, **kw: cfg.build(**kw))
    assert "test_sgd_momentum" in optimizer_names() and "test_echo" in engine_names()
    try:
        _use_registered()
    finally:  # leave the registries as other tests expect them
        engines_mod._ENGINES.pop("test_echo")
        config_mod._CHOICES[EngineConfig].pop("test_echo")
        optimizers_mod._OPTIMIZERS.pop("test_sgd_momentum")


def test_an_experiment_kind_registers_by_decorating_its_run_function(tmp_path):
    from jaxstream.experiment import registry

    @dataclasses.dataclass(frozen=True)
    class StudyConfig:
        seed: int = 0

    @registry.register_experiment("test_study", StudyConfig)
    def run_study(cfg: StudyConfig, run_dir) -> dict:
        return {"seed": cfg.seed, "dir": str(run_dir)}

    try:
        assert registry.get_experiment("test_study").run is run_study
        kind, cfg = registry.load_experiment({"kind": "test_study"}, ["seed=3"])
        assert (kind, cfg) == ("test_study", StudyConfig(seed=3))
        assert registry.get_experiment(kind).run(cfg, tmp_path) == {"seed": 3, "dir": str(tmp_path)}
        with pytest.raises(TypeError, match="run must be callable"):
            registry.register_experiment("test_other", StudyConfig)(3)
    finally:
        registry._EXPERIMENTS.pop("test_study")


def _use_registered():
    cfg = load_config(TrainConfig, {}, ["engine.type=test_echo", "engine.tag=b",
                                        "optimizer.name=test_sgd_momentum",
                                        "optimizer.options={momentum: 0.9}"])
    assert build_engine(cfg.engine, micro_batches=1)[:2] == ("built", "b")
    tx = build_optimizer(cfg.optimizer, 0.1)
    assert isinstance(tx, optax.GradientTransformation)
    with pytest.raises(ConfigError, match=r"^optimizer\.options\.nesterov: unknown option"):
        load_config(TrainConfig, {}, ["optimizer.name=test_sgd_momentum",
                                      "optimizer.options={nesterov: true}"])
    with pytest.raises(ConfigError, match=r"^engine\.tag: expected str"):
        load_config(TrainConfig, {}, ["engine.type=test_echo", "engine.tag=3"])
