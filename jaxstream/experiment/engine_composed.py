"""The ``composed`` engine: pipeline stages that stream their layers, replicas beside them.

``engine: {type: composed, data: 2, stage: 4, store: null, ...}`` trains with
:class:`jaxstream.compose.ComposedExecutor` on a ``data × stage`` mesh: the layers live in a
layer store (one per arm, as for ``type: stream``, whose options it shares), each sweep runs
chunks of ``stage`` layers as GPipe passes over the micro-batches, each micro-batch split over
``data``. Resume, store checks and non-finite refusal are the stream engine's. Metrics add
``ticks`` (the step's pipeline ticks) for plots against ticks.

Example (YAML)::

  engine: {type: composed, data: 2, stage: 4, store: null, micro_batches: 8}
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxstream.compose.executor import Schedule, check_updates_in_flight
from jaxstream.experiment.engine_stream import StreamEngine, StreamEngineConfig
from jaxstream.experiment.engines import register_engine
from jaxstream.ranges import Count, Positive
from jaxstream.stream.store import LayerStore


@register_engine("composed")
@dataclasses.dataclass(frozen=True)
class ComposedEngineConfig(StreamEngineConfig):
    """Options of ``engine: {type: composed}``: the stream engine's, plus the mesh.

    Attributes:
      data: replicas (each micro-batch's examples are split over them).
      stage: pipeline stages (the model's depth must divide by it); data × stage must divide
        the devices.
      schedule: ``circular`` (each sweep one circular pass over its chunks: one fill and one
        drain per sweep, up to ``stage`` exact chains for the ticks of one) or ``chunked`` (one
        GPipe pass per chunk of ``stage`` layers, the earlier schedule).
      peer_timeout_s: under ``jax.distributed``, a peer process silent (or a step without
        progress) this long ends the run with one line and exit status 2; keep it above the
        slowest chunk's time and below half of ``jax.distributed.initialize``'s
        ``heartbeat_timeout_seconds`` (see :mod:`jaxstream.compose.peers`).
    """

    data: Count = 1
    stage: Count = 1
    schedule: Schedule = "circular"
    peer_timeout_s: Positive = 40.0
    async_commit: bool = False  # its copies agree on each committed step before the next

    def check(self) -> None:
        super().check()
        if self.async_commit:
            raise ValueError("async_commit: the composed engine commits each step before the "
                             "next (its store copies must agree on the committed step); "
                             "allowed: false")
        if self.layers_per_unit != 1:
            raise ValueError(f"layers_per_unit: the composed engine's units are its chunks of "
                             f"one layer per stage; allowed: 1, got {self.layers_per_unit}")
        check_updates_in_flight(self.updates_in_flight)
        if self.schedule == "circular" and self.prefetch < 1:
            raise ValueError(f"prefetch: the circular schedule reads the next chunk while "
                             f"one computes, so it must be >= 1, got {self.prefetch} (or "
                             f"engine.schedule: chunked)")

    def units(self, depth: int) -> tuple[int, str]:
        """Prefetch counts chunks of ``stage`` layers here."""
        c = depth // self.stage
        return c + 2, f"embed, {c} chunks of {self.stage} layers, head"

    def check_model(self, model: Any) -> None:
        """The model's depth divides into the stages (when the model section says its depth),
        and the read-ahead stays within its chunks."""
        depth = getattr(model, "depth", None)
        if isinstance(depth, int) and depth % self.stage:
            raise ValueError(f"engine.stage: {self.stage} must divide model.depth = {depth} "
                             f"(allowed: divisors of {depth})")
        super().check_model(model)

    def check_run(self, names: list[str], resume: bool) -> None:
        """The mesh fits the devices (before anything is written), then the stream checks."""
        from jaxstream.compose import make_mesh

        try:
            make_mesh(self.data, self.stage)
        except ValueError as err:
            raise ValueError(f"engine.{err}") from None
        super().check_run(names, resume)

    def engine_class(self) -> type[ComposedEngine]:
        """:meth:`build` makes the composed engine (the stream engine placed over the mesh)."""
        return ComposedEngine


class ComposedEngine(StreamEngine):
    """The stream engine with its executor placed over the mesh."""

    def __init__(self, cfg: ComposedEngineConfig, *, stack: Any, **kw: Any):
        if stack.num_layers % cfg.stage:
            raise ValueError(f"engine.stage: {cfg.stage} must divide the model's "
                             f"{stack.num_layers} layers (model.depth)")
        super().__init__(cfg, stack=stack, **kw)

    def _new_executor(self, store: LayerStore):
        from jaxstream.compose import ComposedExecutor, make_mesh
        from jaxstream.stream.executor import StreamConfig

        scfg = StreamConfig(self.cfg.prefetch, self.cfg.compute_dtype, self.cfg.update,
                            self.cfg.depth)
        return ComposedExecutor(self.stack, self.estimator, self.optimizer, store, scfg,
                                mesh=make_mesh(self.cfg.data, self.cfg.stage),
                                schedule=self.cfg.schedule,
                                peer_timeout_s=float(self.cfg.peer_timeout_s))
