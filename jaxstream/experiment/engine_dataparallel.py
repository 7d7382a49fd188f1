"""The ``dataparallel`` engine: the local engine with its estimator split over a ``data`` axis.

Config: ``engine: {type: dataparallel, devices: 8, allreduce: ring}``.  The optimizer update
runs replicated (every device holds the same params); only the estimate is sharded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxstream.comm.dataparallel import ALLREDUCE, EXCHANGE, TANGENTS, data_parallel
from jaxstream.experiment.engines import LocalEngine, LocalEngineConfig, register_engine

__all__ = ["DataParallelEngineConfig", "build_dataparallel_engine"]


@dataclasses.dataclass(frozen=True)
class DataParallelEngineConfig:
    """Options of the ``dataparallel`` engine.

    Attributes:
      devices: size of the ``data`` axis (0: every device).
      allreduce: ``psum`` or ``ring``.
      exchange: ``gradients`` or ``scalars`` (forward weight perturbation only).
      tangents: ``independent`` (fold the device index into the key) or ``shared``.
    """

    devices: int = 0
    allreduce: str = "psum"
    exchange: str = "gradients"
    tangents: str = "independent"

    def __post_init__(self):
        if self.devices < 0:
            raise ValueError(f"devices: must be >= 0 (0: all), got {self.devices}")
        for name, allowed in (
            ("allreduce", ALLREDUCE),
            ("exchange", EXCHANGE),
            ("tangents", TANGENTS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name}: {getattr(self, name)!r} is not allowed; choose one of {allowed}"
                )


def build_dataparallel_engine(
    cfg: DataParallelEngineConfig, *, estimator: Any, micro_batches: int = 1, **kwargs: Any
) -> LocalEngine:
    """A :class:`LocalEngine` whose estimator runs data-parallel on ``cfg.devices`` devices."""
    available = jax.device_count()
    n = cfg.devices or available
    if n > available:
        raise ValueError(f"engine.devices: {n} requested but only {available} devices exist")
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    dp = data_parallel(
        estimator,
        mesh,
        allreduce=cfg.allreduce,
        exchange=cfg.exchange,
        tangents=cfg.tangents,
        batch_axis=1 if micro_batches > 1 else 0,
    )
    return LocalEngine(LocalEngineConfig(), estimator=dp, micro_batches=micro_batches, **kwargs)


register_engine("dataparallel", DataParallelEngineConfig, build_dataparallel_engine)
