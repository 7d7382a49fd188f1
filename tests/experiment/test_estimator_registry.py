"""Every estimator and every correction of the library is selectable from YAML, and the config
and the estimator agree on every bound (the config reads the library's rule registry, so it
cannot drift from it)."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

import jaxstream.grad as jg
from jaxstream.experiment.config import ConfigError, choices, from_dict
from jaxstream.experiment.estimators import EstimatorConfig
from jaxstream.grad import combine
from jaxstream.ranges import Count  # a field annotation of a class defined in a test

# one YAML section per library factory (the factories are listed by hand here on purpose: a
# factory added to jaxstream.grad without a config type fails the coverage test below)
SECTIONS = {
    "backprop": ("type: backprop", jg.backprop()),
    "backprop_remat": ("type: backprop\nremat: true", jg.backprop_remat()),
    "backprop_remat_accumulate": ("type: backprop\nremat: true\naccumulate: 4",
                                  jg.backprop_remat(accumulate=4)),
    "forward": ("type: forward\nnum_tangents: 3\ndistribution: gaussian\naggregation: projection",
                jg.forward(3, "gaussian", aggregation="projection")),
    "forward_activity": ("type: forward\nperturb: activations\nlocal_losses: true",
                         jg.forward(perturb="activations", local_losses=True)),
    "exact_subset": ("type: exact_subset\nnum_exact: 3", jg.exact_subset(3)),
    "local_forward_weights": ("type: local_forward_weights\nnum_tangents: 2",
                              jg.local_forward_weights(2)),
    "hybrid_activity": ("type: hybrid_activity\nnum_exact: 3", jg.hybrid_activity(3)),
    "local_guess": ("type: local_guess", jg.local_guess()),
    "forward_low_rank": ("type: forward\nnum_tangents: 2\nrank: 3", jg.forward(2, rank=3)),
    "hybrid_exact_from": (("type: hybrid\nmicro_batches: 4\nexact_from: [0, 1, 3, 3]\n"
                          "correction: replace"), jg.hybrid(exact_from=(0, 1, 3, 3),
                                                           correction="replace")),
    "spsa": ("type: spsa\nnum_directions: 2\neps: 0.01\ndistribution: gaussian\nrank: 2",
             jg.spsa(2, 1e-2, "gaussian", rank=2)),
}


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_every_estimator_builds_from_yaml(name):
    text, expected = SECTIONS[name]
    built = from_dict(EstimatorConfig, yaml.safe_load(text)).build()
    assert built == expected
    assert built.plan == expected.plan


@pytest.mark.parametrize("correction", combine.corrections())
def test_every_registered_correction_builds_from_yaml(correction):
    cfg = from_dict(EstimatorConfig, yaml.safe_load(
        f"type: hybrid\ncorrection: {correction}\nnum_exact: 2\nmicro_batches: 4"))
    est = cfg.build()
    assert est == jg.hybrid(num_exact=2, correction=correction)
    assert est.plan.combine == correction


def test_stein_is_selectable():
    """``stein`` was in the library and missing from the config's list once."""
    assert "stein" in combine.corrections()
    cfg = from_dict(EstimatorConfig, {"type": "hybrid", "correction": "stein"})
    assert cfg.build().correction == "stein"


def test_every_factory_has_a_config_type():
    """Each estimator class the library exports is built by some config section."""
    classes = {type(e) for _, e in SECTIONS.values()}
    exported = {getattr(jg, n) for n in jg.__all__ if isinstance(getattr(jg, n), type)
                and hasattr(getattr(jg, n), "plan")}
    assert exported == classes | {jg.Hybrid}
    assert set(choices(EstimatorConfig)) == {
        "backprop", "forward", "hybrid", "exact_subset", "local_forward_weights",
        "hybrid_activity", "local_guess", "spsa"}


@pytest.mark.parametrize("section, match", [
    ({"type": "hybrid", "num_exact": 0}, r"num_exact: must be >= 1, got 0"),
    ({"type": "hybrid", "num_exact": 9}, r"num_exact: must be at most micro_batches = 8, got 9"),
    ({"type": "hybrid", "correction": "mean"}, r"correction: 'mean' is not allowed"),
    ({"type": "hybrid", "correction": "nope"}, r"choose one of 'control_variate', 'replace'"),
    ({"type": "exact_subset", "num_exact": 0}, r"num_exact: must be >= 1"),
    ({"type": "hybrid_activity", "num_exact": 1}, r"num_exact: must be >= 2"),
    ({"type": "hybrid_activity", "num_exact": 8},
     r"num_exact: must be at most micro_batches - 1 = 7, got 8"),
    ({"type": "hybrid", "exact_indices": [0, -1]}, r"exact_indices.1: must be >= 0, got -1"),
    ({"type": "hybrid", "exact_indices": [8]}, r"exact_indices: each index must be in \[0, 8\)"),
])
def test_config_refuses_what_the_estimator_refuses(section, match):
    with pytest.raises(ConfigError, match=match):
        from_dict(EstimatorConfig, section)


def test_config_bounds_agree_with_the_estimator():
    """Whatever the config accepts, the estimator accepts (the lower bounds of every int field
    are tried)."""
    for name, cls in choices(EstimatorConfig).items():
        for f in dataclasses.fields(cls):
            if f.type not in ("int", int):
                continue
            for value in range(4):
                try:
                    cfg = from_dict(EstimatorConfig, {"type": name, f.name: value})
                except ConfigError:
                    continue
                cfg.build()  # must not raise


def test_accumulation_is_refused_where_it_cannot_run():
    """Chunks need rematerialised backprop, and must divide the batch: one line each, at load."""
    from jaxstream.experiment.train_config import TrainConfig

    with pytest.raises(ConfigError, match="accumulate: 4 chunks need remat: true"):
        from_dict(EstimatorConfig, {"type": "backprop", "accumulate": 4})
    arm = {"name": "bp", "estimator": {"type": "backprop", "remat": True, "accumulate": 3}}
    with pytest.raises(ConfigError, match="arms.0.estimator.accumulate: batch_size=64 is not "
                                          "divisible by accumulate=3"):
        from_dict(TrainConfig, {"batch_size": 64, "arms": [arm]})


# each config type's library factory: every argument of the factory must be a field of the
# config (so every argument is settable from YAML; a new argument without a field fails here)
FACTORIES = {"backprop": jg.backprop_remat, "forward": jg.forward, "spsa": jg.spsa,
             "hybrid": jg.hybrid, "exact_subset": jg.exact_subset,
             "local_forward_weights": jg.local_forward_weights, "local_guess": jg.local_guess,
             "hybrid_activity": jg.hybrid_activity}


def test_every_factory_argument_is_a_config_field():
    import inspect

    assert set(FACTORIES) == set(choices(EstimatorConfig))
    for name, factory in FACTORIES.items():
        fields = {f.name for f in dataclasses.fields(choices(EstimatorConfig)[name])}
        missing = set(inspect.signature(factory).parameters) - fields
        assert not missing, f"{name}: {factory.__name__} arguments {missing} have no field"


def test_exact_from_is_checked_at_load():
    base = {"type": "hybrid", "micro_batches": 4}
    with pytest.raises(ConfigError, match="exact_from: one first exact block per micro-batch"):
        from_dict(EstimatorConfig, {**base, "exact_from": [0, 1]})
    with pytest.raises(ConfigError, match="exact_from: give exact_indices or exact_from"):
        from_dict(EstimatorConfig, {**base, "exact_from": [0, 1, 1, 1], "exact_indices": [0]})
    with pytest.raises(ConfigError, match=r"exact_from\.1"):
        from_dict(EstimatorConfig, {**base, "exact_from": [0, -1, 1, 1]})


def test_a_users_estimator_registers_with_the_decorator_every_choice_has():
    """``@register_estimator(name)`` (from the plugin API) on a config class with ``build``:
    selectable from YAML, its fields checked like the library's, and the counts it does not
    declare (micro-batches, tangents) are 1."""
    from jaxstream.experiment import config as config_mod
    from jaxstream.experiment.plugins import register_estimator

    @register_estimator("test_forward_k")
    @dataclasses.dataclass(frozen=True)
    class ForwardK(EstimatorConfig):
        k: Count = 2

        def build(self):
            return jg.forward(self.k)

    try:
        cfg = from_dict(EstimatorConfig, yaml.safe_load("type: test_forward_k\nk: 3"))
        assert isinstance(cfg, ForwardK) and cfg.build() == jg.forward(3)
        # fields it does not declare: one micro-batch, one tangent (what the engines and the
        # memory checks read of every section)
        assert (cfg.micro_batches, cfg.num_tangents) == (1, 1)
        from jaxstream.experiment.train_config import max_tangents

        assert max_tangents([cfg, from_dict(EstimatorConfig, {"type": "forward",
                                                              "num_tangents": 5})]) == 5
        with pytest.raises(ConfigError, match=r"^k: must be >= 1, got 0"):
            from_dict(EstimatorConfig, {"type": "test_forward_k", "k": 0})
    finally:
        config_mod._CHOICES[EstimatorConfig].pop("test_forward_k")


def test_a_section_that_is_not_an_estimator_config_is_refused_at_registration():
    """The runner asks every section for its counts, batch divisor and label: a class that
    does not subclass EstimatorConfig, or has no build, is refused by name when registered."""
    from jaxstream.experiment.plugins import register_estimator

    @dataclasses.dataclass(frozen=True)
    class Plain:
        def build(self):
            return jg.forward()

    with pytest.raises(TypeError, match=r"register_estimator\('plain'\): the config class must "
                                        r"subclass jaxstream.experiment.EstimatorConfig"):
        register_estimator("plain")(Plain)

    @dataclasses.dataclass(frozen=True)
    class NoBuild(EstimatorConfig):
        pass

    with pytest.raises(TypeError, match=r"NoBuild has no build method"):
        register_estimator("no_build")(NoBuild)
    assert "plain" not in choices(EstimatorConfig) and "no_build" not in choices(EstimatorConfig)
