"""The composed engine's device mesh: ``("data", "stage")`` axes, data-parallel replicas by
pipeline stages."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxstream.compose.pipe import DATA, STAGE


def make_mesh(data: int = 1, stage: int = 1, devices: Sequence | None = None) -> Mesh:
    """A ``("data", "stage")`` mesh of ``data × stage`` devices.

    Raises:
      ValueError: sizes below 1, or a mesh that does not divide the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, v in (("data", data), ("stage", stage)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"mesh: {name} must be an int >= 1, got {v!r}")
    size = data * stage
    if size > len(devices) or len(devices) % size:
        raise ValueError(
            f"mesh: data × stage = {data} × {stage} = {size} must divide the {len(devices)} "
            f"available devices (allowed sizes: divisors of {len(devices)}; on a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is imported)")
    return Mesh(np.array(devices[:size]).reshape(data, stage), (DATA, STAGE))
