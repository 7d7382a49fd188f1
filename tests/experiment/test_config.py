"""Typed configs: overrides, errors that name the field, polymorphic sections, YAML round trip."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Annotated, Literal

import pydantic
import pytest

from jaxstream.experiment.config import (
    ConfigError,
    apply_overrides,
    diff_configs,
    dump_yaml,
    from_dict,
    load_config,
    register_choice,
)
from jaxstream.experiment.estimators import ForwardConfig, HybridConfig
from jaxstream.experiment.train_config import TrainConfig


class Shape:
    """A polymorphic test section."""


@register_choice(Shape, "circle")
@dataclasses.dataclass(frozen=True)
class Circle(Shape):
    radius: float = 1.0


@register_choice(Shape, "box")
@dataclasses.dataclass(frozen=True)
class Box(Shape):
    sides: tuple[int, int] = (1, 2)


@dataclasses.dataclass(frozen=True)
class Inner:
    mode: Literal["fast", "slow"] = "fast"
    count: int = 3


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str = "x"
    inner: Inner = Inner()
    shape: Shape = Box(sides=(3, 4))
    tags: tuple[str, ...] = ()
    limit: int | None = None
    scale: float = 1.0


def test_overrides_nested_and_yaml_scalars():
    cfg = load_config(Outer, {"inner": {"count": 5}},
                      ["inner.mode=slow", "scale=1e-3", "limit=null", "tags=[a, b]"])
    assert cfg == Outer(inner=Inner("slow", 5), scale=1e-3, tags=("a", "b"))


def test_override_list_items_by_index():
    data = apply_overrides({"arms": [{"lr": 1}, {"lr": 2}]}, ["arms.1.lr=0.5"])
    assert data == {"arms": [{"lr": 1}, {"lr": 0.5}]}
    with pytest.raises(ConfigError, match=r"arms\.5: index 5 out of range"):
        apply_overrides({"arms": [{"lr": 1}]}, ["arms.5.lr=0.5"])
    # from the end, as in Python (docs/experiments.md says so)
    assert apply_overrides({"arms": [{"lr": 1}, {"lr": 2}]}, ["arms.-1.lr=0.5"]) == data
    with pytest.raises(ConfigError, match=r"arms\.-3: index -3 out of range \(list has 2"):
        apply_overrides({"arms": [{"lr": 1}, {"lr": 2}]}, ["arms.-3.lr=0.5"])


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["inner.speed=1"], r"^inner\.speed: unknown key for Inner; allowed keys: mode, count"),
        (["inner.mode=medium"], r"^inner\.mode: 'medium' is not allowed; choose one of 'fast', 'slow'"),
        (["inner.count=many"], r"^inner\.count: expected int, got 'many'"),
        (["inner.count=true"], r"^inner\.count: expected int"),
        (["scale=abc"], r"^scale: expected float"),
        (["scale=.inf"], r"^scale: expected a finite number, got inf"),
        (["scale=-.inf"], r"^scale: expected a finite number"),
        (["scale=.nan"], r"^scale: expected a finite number, got nan"),
        (["shape.type=star"], r"^shape\.type: 'star' is not registered; choose one of \['box', 'circle'\]"),
        (["shape.sides=[1, 2, 3]"], r"^shape\.sides: expected 2 items, got 3"),
        (["limit=1.5"], r"^limit: expected int"),
        (["nope"], r"must look like key.subkey=value"),
        (["scale=="], r"override scale: '=' is not a value .*one '='"),  # not 'a Python tag'
    ],
)
def test_bad_values_name_the_field(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(Outer, {}, overrides)


def test_polymorphic_section_keeps_default_type_and_values():
    # No `type:`: the default's variant, and its non-class-default values, are kept.
    cfg = load_config(Outer, {"shape": {"sides": [5, 6]}})
    assert cfg.shape == Box(sides=(5, 6))
    cfg = load_config(Outer, {}, ["shape.type=circle", "shape.radius=2"])
    assert cfg.shape == Circle(2.0)


def test_dump_and_reload_round_trip():
    cfg = load_config(TrainConfig, {
        "arms": [{"name": "a", "estimator": {"type": "hybrid", "micro_batches": 4}},
                 {"name": "b", "estimator": {"type": "forward", "perturb": "activations"}}]},
        ["model.width=16", "optimizer.name=sgd", "optimizer.options={momentum: 0.9}"])
    import yaml

    data = yaml.safe_load(dump_yaml(cfg, {"kind": "train"}))
    assert data.pop("kind") == "train"
    again = from_dict(TrainConfig, data)
    assert again == cfg
    assert isinstance(again.arms[0].estimator, HybridConfig)
    assert isinstance(again.arms[1].estimator, ForwardConfig)
    assert diff_configs(cfg, again) == []
    other = load_config(TrainConfig, data, ["steps=7", "arms.1.lr=0.5"])
    assert diff_configs(cfg, other) == ["steps", "arms.1.lr"]


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["modle.width=3"], r"^modle: unknown key for TrainConfig"),
        (["arms.0.estimator.correction=foo"],
         r"^arms\.0\.estimator\.correction: 'foo' is not allowed; choose one of 'control_variate'"),
        (["arms.0.estimator.micro_batches=5"],
         r"^arms\.0\.estimator\.micro_batches: batch_size=64 is not divisible"),
        (["arms.1.estimator.num_tangents=0"], r"^arms\.1\.estimator\.num_tangents: must be >= 1"),
        (["optimizer.name=lion"], r"^optimizer\.name: 'lion' is not a registered optimizer"),
        (["optimizer.options={bogus: 1}"], r"^optimizer\.options\.bogus: unknown option"),
        (["model.activation=swish"], r"^model\.activation: 'swish' is not allowed"),
        (["arms.1.name=a"], r"^arms\.1\.name: 'a' is used twice"),
        (["steps=0"], r"^steps: must be >= 1"),
        (["arms.0.lr=.inf"], r"^arms\.0\.lr: expected a finite number"),
    ],
)
def test_train_config_errors(overrides, pattern):
    base = {"arms": [{"name": "a", "estimator": {"type": "hybrid", "micro_batches": 4}},
                     {"name": "b", "estimator": {"type": "forward"}}]}
    with pytest.raises(ConfigError, match=pattern):
        load_config(TrainConfig, base, overrides)



class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass(frozen=True)
class Mine:
    """A section of one's own: a pydantic constraint, an enum, a path."""

    n: Annotated[int, pydantic.Field(ge=2)] = 3
    mode: Mode = Mode.FAST
    out: Path = Path("runs")


@dataclasses.dataclass(frozen=True)
class HoldsMine:
    mine: Mine = Mine()


def test_a_plugin_section_with_pydantic_constraints_and_types_of_its_own():
    """Configs are read by pydantic: a section of one's own may constrain a field with
    pydantic's ``Field`` and use types pydantic reads (an enum, a path); the scalar rules stay
    jaxstream's (``true`` is not an int), and a constraint's refusal names the field."""
    cfg = load_config(HoldsMine, {"mine": {"n": 4.0, "mode": "slow", "out": "elsewhere"}})
    assert cfg.mine == Mine(4, Mode.SLOW, Path("elsewhere")) and type(cfg.mine.n) is int
    with pytest.raises(ValueError, match=r"^mine\.n: expected int, got True$"):
        load_config(HoldsMine, {"mine": {"n": True}})
    with pytest.raises(ValueError, match=r"^mine\.n: .*greater than or equal to 2, got 1$"):
        load_config(HoldsMine, {"mine": {"n": 1}})
    with pytest.raises(ValueError, match=r"^mine\.mode: .*'fast' or 'slow'.*got 'medium'$"):
        load_config(HoldsMine, {"mine": {"mode": "medium"}})


@dataclasses.dataclass(frozen=True)
class ByName:
    name: str = "a"


@dataclasses.dataclass(frozen=True)
class ByIndex:
    index: int = 0


@dataclasses.dataclass(frozen=True)
class EitherOne:
    pick: ByName | ByIndex | Literal["none"] = "none"


def test_a_union_of_sections_names_the_field_and_each_members_reason():
    """A field that may be one of two sections (or a literal): a value none of them takes is
    refused at the field's own dotted name, with each member's reason."""
    assert load_config(EitherOne, {"pick": {"index": 2}}).pick == ByIndex(2)
    with pytest.raises(ValueError) as err:
        load_config(EitherOne, {"pick": {"index": "x"}})
    msg = str(err.value)
    assert msg.startswith("pick: expected ") and "got {'index': 'x'}" in msg, msg
    assert "pick.index: expected int, got 'x'" in msg and "pick.index: unknown key" in msg, msg
    assert "dataclass" not in msg and "literal" not in msg.split(" (")[0], msg
