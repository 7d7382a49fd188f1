"""The ``dataparallel`` engine: the local engine with its estimator split over a ``data`` axis.

Config: ``engine: {type: dataparallel, devices: 8, allreduce: ring}``.  With ``exchange:
gradients`` (default) or ``scalars`` the estimate is all-reduced and the optimizer update runs
replicated (every device holds the same params and one optimizer state).

With ``exchange: moments`` (optimizer ``max_adabelief`` only) nothing gradient-sized is
all-reduced before the optimizer: each replica runs the Max-AdaBelief recursion on its own
shard's estimate with its own state (m_i, s_i, s^max_i), and the replicas average m̂_i and
s^max_i for the shared update (:func:`jaxstream.optim.max_adabelief_exchange`).  The engine
state then holds every replica's optimizer state, stacked on a leading axis of size
``devices`` and sharded over ``data``, so a checkpoint holds all of them and a resume continues
the same run (on the same number of devices).

Example:
    >>> cfg = DataParallelEngineConfig(devices=4, exchange="moments")
    >>> cfg.check_optimizer(OptimizerConfig(name="max_adabelief"), "optimizer")
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstream.comm.dataparallel import (
    EXCHANGE,
    AllReduce,
    DataParallel,
    Exchange,
    Tangents,
    data_parallel,
)
from jaxstream.experiment.engines import (
    EngineConfig,
    LocalEngine,
    LocalEngineConfig,
    LocalState,
    register_engine,
    split_micro_batches,
)
from jaxstream.experiment.optimizers import OptimizerConfig, build_optimizer
from jaxstream.optim.exchange import max_adabelief_exchange
from jaxstream.ranges import Every

__all__ = ["MOMENT_OPTIMIZERS", "DataParallelEngine", "DataParallelEngineConfig",
           "MomentExchangeEngine", "build_dataparallel_engine"]

MOMENT_OPTIMIZERS = ("max_adabelief",)  # optimizers whose moments ``exchange: moments`` averages


@register_engine("dataparallel")
@dataclasses.dataclass(frozen=True)
class DataParallelEngineConfig(EngineConfig):
    """Options of the ``dataparallel`` engine.

    Attributes:
      devices: size of the ``data`` axis (0: every device).
      allreduce: ``psum`` or ``ring``.
      exchange: ``gradients`` (all-reduce the estimate), ``scalars`` (forward weight
        perturbation only) or ``moments`` (``max_adabelief`` only: per-replica optimizer
        states, m̂ and s^max all-reduced).
      tangents: ``independent`` (fold the device index into the key) or ``shared``.
    """

    devices: Every = 0  # 0: every device
    allreduce: AllReduce = "psum"
    exchange: Exchange = "gradients"
    tangents: Tangents = "independent"

    def check_run(self, names: list[str], resume: bool) -> None:
        """Before anything is written: the devices asked for exist."""
        available = jax.device_count()
        if self.devices > available:
            raise ValueError(f"engine.devices: {self.devices} requested but only {available} "
                             f"devices exist; allowed: 0 (all) .. {available} (on a CPU, set "
                             f"XLA_FLAGS=--xla_force_host_platform_device_count={self.devices} "
                             "before JAX is imported)")

    def check_optimizer(self, opt_cfg: OptimizerConfig, field: str) -> None:
        """``exchange: moments`` averages Max-AdaBelief's moments: refuse any other optimizer
        (``field`` names the optimizer section, e.g. ``arms.1.optimizer``)."""
        if self.exchange == "moments" and opt_cfg.name not in MOMENT_OPTIMIZERS:
            others = tuple(e for e in EXCHANGE if e != "moments")
            raise ValueError(
                f"engine.exchange: 'moments' needs {field}.name in {MOMENT_OPTIMIZERS}, got "
                f"{opt_cfg.name!r}; with that optimizer choose engine.exchange in {others}"
            )

    def build(self, **kw: Any) -> Any:
        """The engine (the registry calls this; keywords: :mod:`jaxstream.experiment.engines`)."""
        return build_dataparallel_engine(self, **kw)


class DataParallelEngine(LocalEngine):
    """The local engine with a data-parallel estimator; its state lives replicated on the
    mesh from the start (as the step returns it), so the step compiles once."""

    def __init__(self, cfg: LocalEngineConfig, *, dp: DataParallel, **kwargs: Any):
        super().__init__(cfg, estimator=dp, **kwargs)
        self.dp = dp

    def init(self, params: Any, key: jax.Array) -> LocalState:
        del key
        params = jax.device_put(params, NamedSharding(self.dp.mesh, P()))
        return LocalState(params, self._opt_state(params))

    def _opt_state(self, params: Any) -> Any:
        """One optimizer state, replicated."""
        return jax.device_put(self.optimizer.init(params), NamedSharding(self.dp.mesh, P()))


class MomentExchangeEngine(DataParallelEngine):
    """The engine of ``exchange: moments``: state = (params, per-replica optimizer states).

    ``opt_state`` leaves have a leading axis of size n (replica i's state in row i), sharded
    over the mesh's ``data`` axis; the metric ``replica_grad_rms`` is the root mean square of
    the replicas' own gradient norms (there is no all-reduced gradient).
    """

    def _opt_state(self, params: Any) -> Any:
        """One optimizer state per replica, stacked and sharded over ``data``."""
        return self.dp.replicate_state(self.optimizer.init(params))

    def _step(self, state: LocalState, batch: dict, key: jax.Array):
        batch = split_micro_batches(batch, self.micro_batches)
        params, opt_state, loss, rms = self.dp.step(
            self.stack, self.optimizer, state.params, state.opt_state, batch, key
        )
        return LocalState(params, opt_state), {"loss": loss, "replica_grad_rms": rms}


def build_dataparallel_engine(
    cfg: DataParallelEngineConfig,
    *,
    estimator: Any,
    micro_batches: int = 1,
    optimizer_config: Any = None,
    learning_rate: float | None = None,
    total_steps: int | None = None,
    **kwargs: Any,
) -> LocalEngine:
    """A :class:`LocalEngine` whose estimator runs data-parallel on ``cfg.devices`` devices.

    With ``exchange: moments`` the optimizer is rebuilt from ``optimizer_config`` at
    ``learning_rate`` over ``total_steps`` (same options, schedule and clipping; clipping then
    applies to each replica's own gradient) as :func:`~jaxstream.optim.max_adabelief_exchange`
    over ``data``.
    """
    available = jax.device_count()
    n = cfg.devices or available
    if n > available:
        raise ValueError(f"engine.devices: {n} requested but only {available} devices exist")
    if cfg.exchange == "moments":
        if optimizer_config is None or learning_rate is None:
            raise ValueError("engine.exchange: 'moments' builds its own optimizer; pass "
                             "optimizer_config= and learning_rate=")
        cfg.check_optimizer(optimizer_config, "optimizer")
    mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
    dp = data_parallel(
        estimator,
        mesh,
        allreduce=cfg.allreduce,
        exchange=cfg.exchange,
        tangents=cfg.tangents,
        batch_axis=1 if micro_batches > 1 else 0,
    )
    if cfg.exchange != "moments":
        return DataParallelEngine(LocalEngineConfig(), dp=dp, micro_batches=micro_batches,
                                  **kwargs)
    factory = functools.partial(max_adabelief_exchange, axis_name="data",
                                allreduce=cfg.allreduce)
    kwargs["optimizer"] = build_optimizer(optimizer_config, learning_rate, total_steps,
                                          factory=factory)
    return MomentExchangeEngine(LocalEngineConfig(), dp=dp, micro_batches=micro_batches,
                                **kwargs)
