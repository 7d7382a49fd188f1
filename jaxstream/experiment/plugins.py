"""Everything a plugin needs to extend ``jaxstream run``, under public names.

A plugin is a module that registers what it adds when imported. ``jaxstream run CONFIG --plugin
MODULE`` imports it (repeatable); an installed package can instead declare an entry point of
the group ``jaxstream.plugins``::

    [project.entry-points."jaxstream.plugins"]
    my_data = "my_package.jaxstream_plugin"

An installed entry point that fails to load stops ``jaxstream run`` with one line naming it,
its package and the error; ``JAXSTREAM_SKIP_PLUGINS=my_data`` (names, comma-separated) skips it.

Registrations, each a decorator with the name YAML uses: :func:`register_dataset` (``data:
{type: NAME}``, on a config class with ``load``), :func:`register_model` (``model: {type:
NAME}``, with ``build``), :func:`register_engine` (``engine: {type: NAME}``, with ``build``),
:func:`register_estimator` (``estimator: {type: NAME}``, with ``build``),
:func:`register_experiment` (``kind: NAME``, on the run function, given its config class),
:func:`register_optimizer` (``optimizer: {name: NAME}``, on a factory) and the general
:func:`register_choice`.
Base classes: :class:`DataConfig` (``load(seed) -> Dataset``), :class:`ModelConfig`
(``build(info) -> model``), :class:`EngineConfig` and :class:`Engine`, :class:`Dataset`.

Example (``my_data.py``, a dataset of random blobs)::

    import dataclasses
    import numpy as np
    from jaxstream.experiment.plugins import DataConfig, Dataset, register_dataset

    @register_dataset("blobs")
    @dataclasses.dataclass(frozen=True)
    class Blobs(DataConfig):
        n: int = 256

        def load(self, seed: int) -> Dataset:
            rng = np.random.default_rng(seed)
            y = rng.integers(0, 3, self.n).astype(np.int32)
            x = (rng.normal(size=(self.n, 8)) + y[:, None]).astype(np.float32)
            half = self.n // 2
            return Dataset({"x": x[:half], "y": y[:half]}, {"x": x[half:], "y": y[half:]},
                           {"in_dim": 8, "num_classes": 3})

    # jaxstream run experiments/quickstart.yaml --plugin my_data data={type: blobs}
"""

from __future__ import annotations

from collections.abc import Callable

from jaxstream.data.digits import Dataset
from jaxstream.experiment.config import register_choice
from jaxstream.experiment.data_configs import DataConfig
from jaxstream.experiment.engines import Engine, EngineConfig, register_engine
from jaxstream.experiment.estimators import EstimatorConfig, register_estimator
from jaxstream.experiment.model_configs import ModelConfig
from jaxstream.experiment.optimizers import register_optimizer
from jaxstream.experiment.registry import ENTRY_POINT_GROUP, load_plugins, register_experiment
from jaxstream.ranges import (
    Checked,
    Count,
    Decay,
    Every,
    Fraction,
    NonNegative,
    Positive,
    Probability,
    Range,
    Seed,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Checked",
    "Count",
    "DataConfig",
    "Dataset",
    "Decay",
    "Engine",
    "EngineConfig",
    "EstimatorConfig",
    "Every",
    "Fraction",
    "ModelConfig",
    "NonNegative",
    "Positive",
    "Probability",
    "Range",
    "Seed",
    "load_plugins",
    "register_choice",
    "register_dataset",
    "register_engine",
    "register_estimator",
    "register_experiment",
    "register_model",
    "register_optimizer",
]


def register_dataset(name: str) -> Callable[[type], type]:
    """Decorator: a frozen dataclass with ``load(seed) -> Dataset`` becomes ``data: {type: name}``."""
    return register_choice(DataConfig, name)


def register_model(name: str) -> Callable[[type], type]:
    """Decorator: a frozen dataclass with ``build(info) -> model`` becomes ``model: {type: name}``.

    ``info`` holds the data set's facts (``in_dim``, ``num_classes``, ...); the model is a
    :class:`~jaxstream.models.Stack` (every engine) or a ``from_sequential`` model.
    """
    return register_choice(ModelConfig, name)
