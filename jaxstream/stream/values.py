"""Host values of device arrays, also of arrays spread over several processes."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def host_value(tree: Any) -> Any:
    """NumPy values of a pytree of arrays, also of arrays spread over several processes
    (gathered: every process calls this in the same order)."""
    def one(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(jax.device_get(a))
    return jax.tree.map(one, tree)


def on_host(host: Any) -> contextlib.AbstractContextManager:
    """``jax.default_device(host)``, or nothing where ``host`` already is the default device
    (a CPU backend): a jitted call under ``jax.default_device`` leaves JAX's C++ dispatch path
    and costs about three times as much, once per unit per step on the host's threads."""
    if jax.config.jax_default_device is None and host == jax.devices()[0]:
        return contextlib.nullcontext()
    return jax.default_device(host)
