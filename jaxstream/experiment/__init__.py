"""Reproducible experiments: typed YAML configs, engines, experiment kinds and the runner."""

from jaxstream.experiment.config import (
    apply_overrides,
    choices,
    dump_yaml,
    from_dict,
    load_config,
    register_choice,
    to_dict,
)
from jaxstream.experiment.engines import (
    Engine,
    EngineConfig,
    LocalEngine,
    LocalEngineConfig,
    build_engine,
    engine_names,
    register_engine,
    split_micro_batches,
)
from jaxstream.experiment.estimators import (
    BackpropConfig,
    EstimatorConfig,
    ForwardConfig,
    HybridConfig,
)
from jaxstream.experiment.optimizers import (
    OptimizerConfig,
    build_optimizer,
    optimizer_names,
    register_optimizer,
)
from jaxstream.experiment.registry import (
    experiment_kinds,
    get_experiment,
    load_experiment,
    register_experiment,
)

__all__ = [
    "BackpropConfig",
    "Engine",
    "EngineConfig",
    "EstimatorConfig",
    "ForwardConfig",
    "HybridConfig",
    "LocalEngine",
    "LocalEngineConfig",
    "OptimizerConfig",
    "apply_overrides",
    "build_engine",
    "build_optimizer",
    "choices",
    "dump_yaml",
    "engine_names",
    "experiment_kinds",
    "from_dict",
    "get_experiment",
    "load_config",
    "load_experiment",
    "optimizer_names",
    "register_choice",
    "register_engine",
    "register_experiment",
    "register_optimizer",
    "run_experiment",
    "split_micro_batches",
    "to_dict",
]


def run_experiment(*args, **kwargs):
    """See :func:`jaxstream.experiment.runner.run_experiment`."""
    from jaxstream.experiment.runner import run_experiment as run

    return run(*args, **kwargs)
