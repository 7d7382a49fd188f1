"""Declared ranges: every numeric config field declares one, and every shipped config refuses
a value just outside it (and NaN, ±inf) with one line naming the dotted field."""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import pytest

from jaxstream.experiment.config import ConfigError, choices, from_dict
from jaxstream.experiment.registry import experiment_kinds, get_experiment
from jaxstream.ranges import Checked, Count, Range, declared, numeric

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import config_walk

# A dict of options whose ranges are per option name (optimizers.OPTION_RANGES).
PER_KEY = {("OptimizerConfig", "options")}


@pytest.mark.parametrize("rng, inside, outside, text", [
    (Range(0.0, lo_open=True), [1e-30, 5.0], [0.0, -1.0, math.nan, math.inf], "> 0"),
    (Range(1), [1, 10**12], [0, -3], ">= 1"),
    (Range(0.0, 1.0, lo_open=True), [1.0, 0.5], [0.0, 1.0000001, -math.inf], "in (0, 1]"),
    (Range(0.0, 1.0, hi_open=True), [0.0, 0.999], [1.0, -1e-9, math.nan], "in [0, 1)"),
    (Range(0, 2**32 - 1), [0, 2**32 - 1], [-1, 2**32], "in [0, 4294967295]"),
])
def test_a_range_holds_what_it_says(rng, inside, outside, text):
    assert str(rng) == text
    assert all(v in rng for v in inside)
    assert not any(v in rng for v in outside)


def _config_classes() -> set[type]:
    """Every config dataclass a YAML file can reach: each kind's config, every registered
    choice of a polymorphic section, and every dataclass nested in those."""
    from jaxstream.experiment.config import _CHOICES

    todo = [get_experiment(k).config_cls for k in experiment_kinds()]
    todo += [c for base in _CHOICES for c in choices(base).values()]
    seen: set[type] = set()
    while todo:
        cls = todo.pop()
        if cls in seen or not dataclasses.is_dataclass(cls):
            continue
        seen.add(cls)
        for tp, _ in declared(cls).values():
            stack = [tp]
            while stack:
                t = stack.pop()
                if dataclasses.is_dataclass(t):
                    todo.append(t)
                stack.extend(a for a in typing.get_args(t) if isinstance(a, type)
                             or typing.get_args(a))
    return seen


def test_every_numeric_config_field_declares_its_range():
    # the library's own (other tests register users' plugin sections in this process)
    classes = {c for c in _config_classes() if c.__module__.startswith("jaxstream.")}
    assert len(classes) >= 25  # the kinds, engines, estimators, models, data, arms, ...
    missing = [f"{cls.__name__}.{name}" for cls in classes
               for name, (tp, rng) in declared(cls).items()
               if numeric(tp) and rng is None and (cls.__name__, name) not in PER_KEY]
    assert not missing, f"numeric fields without a declared range: {missing}"
    unchecked = [cls.__name__ for cls in classes if not issubclass(cls, Checked)]
    assert not unchecked, f"config classes whose ranges are never checked: {unchecked}"


def _outside(rng: Range, is_int: bool) -> list[float]:
    step = 1 if is_int else 1e-6
    out = [] if is_int else [math.nan, math.inf, -math.inf]
    if rng.lo is not None:
        out.append(rng.lo if rng.lo_open else rng.lo - step)
    if rng.hi is not None:
        out.append(rng.hi if rng.hi_open else rng.hi + step)
    return out


@pytest.mark.parametrize("name", ["quickstart.yaml", "stream_mlp.yaml",
                                  "forward_table_quick.yaml", "grad_quality_mlp.yaml"])
def test_every_field_of_a_shipped_config_refuses_values_outside_its_range(name):
    from jaxstream.experiment.registry import load_experiment

    path = ROOT / "experiments" / name
    _, cfg = load_experiment(path)
    fields = config_walk.numeric_paths(cfg)
    assert len(fields) >= 10
    tried = 0
    for field, rng in fields.items():
        is_int = isinstance(_value(cfg, field), int)
        for v in _outside(rng, is_int):
            tried += 1
            err = config_walk.try_case(path, [f"{field}={config_walk._yaml(v)}"])
            assert err is not None, f"{name}: {field}={v} accepted outside {rng}"
            assert "\n" not in err and err.startswith(f"{field}:"), (field, v, err)
    assert tried >= len(fields)


def _value(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if isinstance(node, (tuple, list)):
            node = node[int(part)]
        elif isinstance(node, Mapping):
            node = node.get(part, 0.5)  # an option the config leaves unset: a float
        else:
            node = getattr(node, part)
    return node


def test_cross_field_checks_name_the_field_before_anything_is_written(tmp_path):
    from jaxstream.experiment.runner import run_experiment

    quick = ROOT / "experiments" / "quickstart.yaml"
    for overrides, match in [
        (["batch_size=100000"], (r"batch_size: 100000 exceeds the 1438 training examples of the "
                                r"data set; allowed: 1..1438")),
        (["steps=10", "max_steps=11"], r"max_steps: stops before steps = 10, so at most 10"),
        (["steps=10", "optimizer.warmup_steps=11"],
         r"optimizer.warmup_steps: the warm-up must end within steps = 10, got 11"),
        (["data={type: mnist1d, num_samples: 100000000000}"], (r"data: holds about .* GiB; this "
                                                             r"machine has")),
        (["data={type: chars, num_train: 16, seq_len: 8}", "batch_size=32",
          "model={type: char_transformer}"], r"batch_size: 32 exceeds the 16 training examples"),
        (["arms.1.estimator.num_tangents=1000000000000"], (r"model: needs about .* GiB .*"
                                                          r"1000000000000 tangents \(arms\.1\."
                                                          r"estimator\.num_tangents\)")),
        (["model.depth=1000000000000", "engine={type: stream}",
          "arms=[{name: bp, estimator: {type: backprop}}]"],
         r"model: its layer store needs about .* GiB and .* free"),
    ]:
        out = tmp_path / "run"
        with pytest.raises(ConfigError, match=match):
            run_experiment(quick, overrides, out=out)
        assert not out.exists()


@dataclasses.dataclass(frozen=True)
class Mine(Checked):
    """A section as a user's plugin would declare it."""

    width: Count = 4
    share: Annotated[float, Range(0.0, 0.5)] = 0.25
    sizes: tuple[Count, ...] = (1,)


@dataclasses.dataclass(frozen=True)
class Outer(Checked):
    mine: Mine = Mine()


def test_a_plugin_section_declares_its_ranges_the_same_way():
    assert from_dict(Outer, {"mine": {"share": 0.5}}).mine.share == 0.5
    for data, match in [({"share": 0.6}, r"mine.share: must be in \[0, 0.5\], got 0.6"),
                        ({"width": 0}, r"mine.width: must be >= 1, got 0"),
                        ({"sizes": [2, 0]}, r"mine.sizes.1: must be >= 1, got 0"),
                        ({"share": math.nan}, r"mine.share: expected a finite number")]:
        with pytest.raises(ConfigError, match=match):
            from_dict(Outer, {"mine": data})
    with pytest.raises(ValueError, match=r"width: must be an integer >= 1, got 2.5"):
        Mine(width=2.5)


def test_sweeps_check_their_lanes_against_memory(tmp_path):
    from jaxstream.experiment.runner import run_experiment

    table = ROOT / "experiments" / "forward_table_quick.yaml"
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"datasets.0.model: needs about .* lanes side by "
                                          r"side \(seeds × .*or use fewer lanes"):
        run_experiment(table, ["seeds=100000000000"], out=out)
    assert not out.exists()
    with pytest.raises(ConfigError, match=r"datasets.0.batch_size: 5000 exceeds the"):
        run_experiment(table, ["datasets.0.batch_size=5000", "datasets.0.steps=5000",
                               "datasets.0.eval_every=50", "report={}", "arms=[{name: BP, lrs: [0.001]}]"],
                       out=out)
    assert not out.exists()
