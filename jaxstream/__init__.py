"""jaxstream: forward-mode (jvp) gradient estimators, pipelines whose bubbles run reverse mode,
and training with layers streamed from TensorStore.

Subpackages load on first use, so ``import jaxstream as js`` is cheap and ``js.grad.forward``
works as ``optax.adam`` does.

Example:
    >>> import jaxstream as js
    >>> est = js.grad.forward(num_tangents=4)
    >>> stack = js.models.mlp(64, 32, 2, 10)
    >>> step = js.train_step(est, optax.adam(1e-3), stack)
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

from jaxstream import xla_guard as _xla_guard

#: What the guard against jaxlib 0.10.2's CPU miscompilation did (:mod:`jaxstream.xla_guard`).
XLA_GUARD = _xla_guard.install()

__version__ = "0.1.0"

#: Subpackages reachable as attributes of ``jaxstream`` (imported on first access).
SUBPACKAGES = ("comm", "compose", "data", "experiment", "grad", "models", "optim", "pipeline",
               "placement", "quality", "stream", "training")

#: Top-level names re-exported from a submodule (imported on first access).
_NAMES = {"train_step": "jaxstream.training", "from_sequential": "jaxstream.models.sequential"}

__all__ = ["__version__", "comm", "compose", "data", "experiment", "from_sequential", "grad", "models",
           "optim", "pipeline", "placement", "quality", "stream", "train_step",
           "training"]

if TYPE_CHECKING:  # for type checkers and IDEs; not executed
    from jaxstream import (
        comm,
        compose,
        data,
        experiment,
        grad,
        models,
        optim,
        pipeline,
        placement,
        quality,
        stream,
        training,
    )
    from jaxstream.models.sequential import from_sequential
    from jaxstream.training import train_step


def __getattr__(name: str) -> object:
    if name in SUBPACKAGES:
        module = _importlib.import_module(f"jaxstream.{name}")
    elif name in _NAMES:
        module = getattr(_importlib.import_module(_NAMES[name]), name)
    else:
        raise AttributeError(f"module 'jaxstream' has no attribute {name!r}")
    globals()[name] = module
    return module


def __dir__() -> list[str]:
    """The public names only (``__all__``): what ``dir(js)`` and tab completion show."""
    return sorted(__all__)
