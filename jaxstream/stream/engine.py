"""The ``stream`` engine: ``engine: {type: stream, ...}`` trains with layers streamed from a store.

The store *is* the checkpoint of the parameters and optimizer state: every step commits to it
atomically, so the engine's own state (saved by the runner with orbax) is just the step
counter. On resume, the runner restores that counter and the engine reopens the same store;
steps the store already committed (a run killed between the store's commit and the orbax
save) are not recomputed but reported from the loss history kept in the store.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxstream.experiment.engines import register_engine, split_micro_batches
from jaxstream.stream.depth import DepthPolicy
from jaxstream.stream.errors import StoreError, StoreNotFoundError
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from jaxstream.stream.store import LayerStore

HISTORY = 64  # losses of the last steps kept in the store's manifest


@dataclasses.dataclass(frozen=True)
class StreamEngineConfig:
    """Options of ``engine: {type: stream}``.

    Attributes:
      store: where the layer store lives (a path or a TensorStore kvstore URL; ``{arm}`` is
        replaced by the arm's name). ``null``: a new temporary directory per arm.
      prefetch: layers read ahead of the computing one.
      compute_dtype: dtype on the device; the master copy and optimizer stay fp32.
      update: "eager" or "lazy" (forward estimator only).
      micro_batches: N for backprop/forward (a hybrid estimator brings its own N).
      depth: dynamic depth policy (kind: all | stochastic | progressive).
      file_io_concurrency: TensorStore's concurrent file operations.
    """

    store: str | None = None
    prefetch: int = 2
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    update: Literal["eager", "lazy"] = "eager"
    micro_batches: int = 1
    depth: DepthPolicy = dataclasses.field(default_factory=DepthPolicy)
    file_io_concurrency: int = 64

    def __post_init__(self):
        if self.prefetch < 0:
            raise ValueError(f"engine.prefetch: must be >= 0, got {self.prefetch}")
        if self.micro_batches < 1:
            raise ValueError(f"engine.micro_batches: must be >= 1, got {self.micro_batches}")
        if self.file_io_concurrency < 1:
            raise ValueError(f"engine.file_io_concurrency: must be >= 1, got {self.file_io_concurrency}")


class StreamState(NamedTuple):
    """The engine state orbax saves: the step (parameters live in the store)."""

    step: jax.Array


class StreamEngine:
    """Engine protocol over a :class:`StreamedExecutor` (see module docstring)."""

    def __init__(self, cfg: StreamEngineConfig, *, stack: Any, estimator: Any, optimizer: Any,
                 config: Any = None, arm: Any = None, micro_batches: int = 1, **_: Any):
        self.cfg, self.stack, self.estimator, self.optimizer = cfg, stack, estimator, optimizer
        self.micro_batches = micro_batches if micro_batches > 1 else cfg.micro_batches
        name = getattr(arm, "name", "arm")
        self.location = (cfg.store.replace("{arm}", name) if cfg.store
                         else tempfile.mkdtemp(prefix=f"jaxstream-store-{name}-"))
        model = getattr(config, "model", None)
        self.model_config = ({"type": type(model).__name__, **dataclasses.asdict(model)}
                             if dataclasses.is_dataclass(model) else {"name": stack.name})
        self.model_config["num_layers"] = stack.num_layers
        self.executor: StreamedExecutor | None = None

    def _executor(self, params: Any = None) -> StreamedExecutor:
        if self.executor is None:
            try:
                store = LayerStore.open(self.location, optimizer=self.optimizer,
                                        model_config=self.model_config,
                                        file_io_concurrency=self.cfg.file_io_concurrency)
            except StoreNotFoundError:
                if params is None:
                    raise
                store = LayerStore.create(self.location, jax.device_get(params),
                                          optimizer=self.optimizer, model_config=self.model_config,
                                          file_io_concurrency=self.cfg.file_io_concurrency)
            scfg = StreamConfig(self.cfg.prefetch, self.cfg.compute_dtype, self.cfg.update,
                                self.cfg.depth)
            self.executor = StreamedExecutor(self.stack, self.estimator, self.optimizer, store, scfg)
        return self.executor

    def init(self, params: Any, key: jax.Array) -> StreamState:
        """Creates the store from ``params`` (or reopens an existing store of this model)."""
        del key
        self._executor(params)
        return StreamState(jnp.asarray(0, jnp.int32))

    def step(self, state: StreamState, batch: dict, key: jax.Array) -> tuple[StreamState, dict]:
        ex = self._executor()
        s = int(state.step)
        history = ex.store.extra.get("losses", {})
        if ex.store.step > s:  # already committed before a crash: report, do not redo
            loss = history.get(str(s + 1), float("nan"))
            return StreamState(jnp.asarray(s + 1, jnp.int32)), {"loss": loss}
        if ex.store.step < s:
            raise StoreError(f"store at {self.location} is at step {ex.store.step}, behind the "
                             f"checkpointed step {s}: it is not this run's store")
        micro = split_micro_batches(batch, self.micro_batches)
        if self.micro_batches == 1:
            micro = jax.tree.map(lambda a: a[None], micro)
        keep = {k: v for k, v in history.items() if int(k) > s + 1 - HISTORY}
        m = ex.step(micro, key, step=s, extra=lambda loss: {"losses": {**keep, str(s + 1): loss}})
        return StreamState(jnp.asarray(s + 1, jnp.int32)), {
            "loss": m["loss"], "stall_s": m["stall_s"], "layers_read": float(m["layers_read"])}

    def estimate(self, state: StreamState, batch: dict, key: jax.Array):
        ex = self._executor()
        micro = split_micro_batches(batch, self.micro_batches)
        if self.micro_batches == 1:
            micro = jax.tree.map(lambda a: a[None], micro)
        loss, grads = ex.estimate(micro, key, step=int(state.step))
        return jnp.asarray(loss), jax.tree.map(jnp.asarray, grads)

    def params(self, state: StreamState) -> Any:
        """All parameters read from the store (pending lazy updates applied first)."""
        ex = self._executor()
        ex.flush()
        return jax.tree.map(jnp.asarray, ex.store.read_params())


register_engine("stream", StreamEngineConfig, lambda cfg, **kw: StreamEngine(cfg, **kw))
