"""Streamed layer-to-layer execution of one training step over a :class:`LayerStore`.

For l in the step's layers: wait for layer l (prefetched ``p`` ahead), put it on the device,
apply it to *all* micro-batches, release it: device memory holds (p + 1) layers plus the
micro-batches' activations, whatever the depth. The optimizer runs on the host in fp32 on the
fp32 master copy (:mod:`~jaxstream.stream.host_queue`), beside the sweeps; updates an
estimator can defer wait for the layer's next read (:mod:`~jaxstream.stream.pending`). Each
estimator's sweeps are in :mod:`jaxstream.stream.sweeps`; this class keeps I/O, prefetch
(:class:`~jaxstream.stream.driver.Driver`), the update queue and the commit: every step ends
with :meth:`LayerStore.commit`, so its writes become visible together.

A step's metrics (:meth:`StreamedExecutor.step`): loss, ``step_time_s``, and the main
thread's idle time per cause: ``stall_s`` (waiting for a layer's read), ``wait_update_s``
(waiting for the host
worker — optimizer updates and scratch writes — which runs beside the sweeps:
``host_update_s`` is its total, mostly overlapped, ``wait_write_s`` the part of it
spent waiting for staged writes past ``max_write_bytes``), ``wait_commit_s`` (the
commit: the step's writes, then the manifest written and fsynced; with ``async_commit``
both on a thread, the step waiting only to build the manifest), ``idle_s``
(stall, update and commit waits summed: the rest of the step is the main thread's
dispatch and host work); the device's idle per cause, the parts of those waits
after the work already dispatched was computed (:mod:`~jaxstream.stream.idle`):
``stall_idle_s``, ``wait_update_idle_s``, ``wait_commit_s``, summed as
``device_idle_s``; ``layers_read``; a placement's own (ticks). The main thread
never waits for the device: it reads the step's few scalars (loss, directional
derivatives, a selection) once.

Bytes the step's executed reads and writes moved (:mod:`~jaxstream.stream.io_bytes`):
``bytes_read`` / ``bytes_written`` in all, per kind ``bytes_read_<kind>`` /
``bytes_written_<kind>`` for ``params``, ``opt`` (optimizer state), ``scratch``,
``carry`` (a deferred update's carried group means) and ``manifest`` (the writer's
check at the first write; the commit), ``bytes_written_pending`` (the deferred
updates' records, part of the manifest written), and ``bytes_read_per_layer`` /
``bytes_written_per_layer``: the totals over the layers the step ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.grad.checks import (
    check_key,
    check_labels,
    check_local_losses,
    check_micro_batches,
    check_stack,
)
from jaxstream.grad.tangents import TangentSpec
from jaxstream.models.stack import Stack
from jaxstream.optim.promotion import standard_promotion
from jaxstream.stream import lazy
from jaxstream.stream.config import DTYPES, UPDATES, StreamConfig, plan_of
from jaxstream.stream.driver import Driver
from jaxstream.stream.elementwise import check_elementwise, check_units
from jaxstream.stream.host_queue import HostQueue, new_clock
from jaxstream.stream.pending import Pending
from jaxstream.stream.placement import Placement, placement_for
from jaxstream.stream.prefetch import Event
from jaxstream.stream.store import LayerStore
from jaxstream.stream.sweeps import sweeps_of
from jaxstream.stream.sweeps.forward import forward_sweep
from jaxstream.stream.units import LayerKey, Unit
from jaxstream.stream.values import host_value

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DTYPES", "UPDATES", "StreamConfig", "StreamedExecutor", "plan_of"]


class StreamedExecutor(Driver):
    """Runs training steps of ``stack`` whose parameters live in ``store``.

    Args:
      stack: the model.
      estimator: ``jaxstream.grad`` backprop(), forward(perturb="weights") or hybrid().
      optimizer: an element-wise optax transformation (applied per layer on the host).
      store: a :class:`LayerStore` opened with the same optimizer.
      config: :class:`StreamConfig`.
      device: where layers compute (default: the first device); the host optimizer runs on
        the CPU.

    Example::

        with StreamedExecutor(stack, jg.forward(), optax.adam(1e-3), store) as ex:
            metrics = ex.step(micro_batched_batch, key)   # leaves (N, B, ...)
        # closed: its host updates applied, its threads ended (the store stays open)
    """

    engine = "stream"  # the name its errors give

    def __init__(self, stack: Stack, estimator: Any, optimizer: Any, store: LayerStore,
                 config: StreamConfig | None = None, device: Any = None,
                 placement: Placement | None = None):
        check_stack(stack, type(self).__name__)
        config = config or StreamConfig()
        if store.num_layers != stack.num_layers:
            raise ValueError(f"store has {store.num_layers} layers, the model {stack.num_layers}")
        self.plan = plan_of(estimator, config.update, self.engine)
        check_local_losses(stack, self.plan.local_target, "stream")
        shapes = jax.eval_shape(stack.init, jax.random.key(0))
        self.stack, self.estimator, self.store, self.cfg = stack, estimator, store, config
        self.optimizer = standard_promotion(optimizer)  # optax's arithmetic: optax's rules
        # a store of another model (widths, leaf names) or another optimizer's state: refused
        store.check_model(shapes, self.optimizer)
        check_elementwise(self.optimizer, jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape[1:], x.dtype), shapes["blocks"]), self.engine)
        check_units(self.optimizer, shapes, self.engine)
        self.spec: TangentSpec = self.plan.spec
        self.host = jax.local_devices(backend="cpu")[0]
        self.dtype = jnp.dtype(config.compute_dtype)
        self.placement = placement_for(self.plan, stack, self.dtype, config, self.engine,
                                       placement, device)
        self.placement.agree(store)
        self.events: list[Event] = []
        self.queue = HostQueue(store, self.optimizer, self.host, config.overlap_update,
                               latest=lambda: self._latest,
                               in_flight=config.updates_in_flight)
        self.pending = Pending(self, lazy.waiting(store.extra))
        self._resident: tuple | None = None  # (unit, hosts, device params) kept for the reverse
        self._reused = 0  # layers the reverse sweep took from the forward sweep (no read)
        self._closed = False
        self._commit_seen = (store.step, store.generation)

    # ------------------------------------------------------------------ loading
    def _block_hosts(self, unit: Unit, staged: bool = False) -> list:
        """Host params of each layer of a block unit (lazy updates applied unless ``staged``:
        the reverse sweep reads what this step staged)."""
        layers = unit.layers
        futures = [self.store.read(l, staged=staged) for l in layers]
        hosts = [f.result() for f in futures]
        return hosts if staged else [self.pending.apply(l, h) for l, h in zip(layers, hosts)]

    def _load(self, unit: Unit) -> tuple[Any, Any]:
        """(host params of the embed / head, or None for a block unit; device params)."""
        if not unit.is_block:
            host = self.pending.apply(unit.key, self.store.read(unit.key).result())
            return host, self._to_device(host)
        return None, self.placement.put(unit, self._block_hosts(unit))

    @property
    def clock(self) -> dict:
        """The last step's host-side time per cause (see :meth:`step`)."""
        return self.queue.clock

    # ------------------------------------------------------------------ public
    def layers(self, step: int) -> tuple[int, ...]:
        """The layers the step runs (the depth policy)."""
        return self.cfg.depth.layers(step, self.store.num_layers)

    def step(self, batch: dict, key: jax.Array, step: int | None = None,
             extra: dict | Callable[[float], dict] | None = None) -> dict:
        """One optimizer step on ``batch`` (leaves (N, B, ...)); commits it to the store.

        Args:
          batch: micro-batched batch, leaves (N, B, ...).
          key: the step's key (tangents, selection), as for the in-memory estimators.
          step: the step number (default: the store's); picks the layers of the depth policy.
          extra: JSON metadata committed with the step (merged into the store's), or a
            function of the step's loss returning it.

        Returns:
          metrics: the step's loss, time, waits per cause and bytes moved (the module's
          docstring lists them).
        """
        key = self._checked(batch, key, read_labels=False)
        at = self.store.step
        step = at if step is None else int(step)
        if step < at:  # committed as step + 1: the store's step would go back
            raise ValueError(f"step: {step} is before the store's step {at}; the step commits "
                             f"step + 1, so it must be at least {at} (default: the store's)")
        t0 = time.perf_counter()
        self.events, self.queue.clock = [], new_clock()
        self.store.io.reset()
        self.placement.begin_step()
        pending = self.pending.snapshot()
        try:
            with jax.profiler.StepTraceAnnotation("stream_step", step_num=step):
                loss, run_extra = self._run(batch, key, self.layers(step), self.queue.update, t0)
                # device labels read once the sweeps are done (the loss read drained the
                # device already): out of range, the step is dropped before its commit
                check_labels(self.stack, batch, self.engine)
                self._commit(step + 1, {**run_extra, **((extra(float(loss)) if callable(extra)
                                                         else extra) or {})})
        except BaseException as e:
            self.queue.drop()
            self.store.abort()  # a failed step leaves no trace: a retry redoes it exactly
            self.pending = Pending(self, pending if self.store.step == at  # else the step
                                   else lazy.waiting(self.store.extra))  # before is lost
            self.placement.end_step(e)
            raise
        self.placement.agree(self.store)  # the copies committed the same step, or this raises
        self.placement.end_step()
        return self._metrics(loss, time.perf_counter() - t0)

    def _commit(self, step: int, extra: dict) -> None:
        """Waits for the host worker, then commits ``step`` (on a thread with
        ``async_commit``), timed as ``wait_commit_s``."""
        self.queue.wait()
        tc = time.perf_counter()
        with jax.profiler.TraceAnnotation("commit"):
            self.store.commit(step, extra={**self.store.extra, **extra},
                              wait=not self.cfg.async_commit)
        self._commit_seen = (self.store.step, self.store.generation)
        self.clock["wait_commit_s"] += time.perf_counter() - tc

    def _checked(self, batch: Any, key: Any, read_labels: bool = True) -> jax.Array:
        """The in-memory estimators' argument checks (a micro-batched batch, integer labels in
        range, a key), before anything runs; labels on a device are read back for it (a few
        integers; out of range they would give a nan loss and a committed step that changed
        nothing), or with ``read_labels=False`` left to :meth:`step`, which reads them after its
        sweeps, before the commit. A raw ``jax.random.PRNGKey`` comes back typed."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}: this executor is closed (its host "
                               "worker has ended); build a new one on the store to go on")
        self._sync_pending()
        check_key(key, self.engine)
        check_micro_batches(batch, self.engine)
        check_labels(self.stack, batch, self.engine, read=read_labels)  # NumPy ones always
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        return key

    def _sync_pending(self) -> None:
        """The deferred updates as the store's last commit holds them, where another executor
        on the same store committed since this one did (its records would be lost)."""
        commit = (self.store.step, self.store.generation)
        if commit != self._commit_seen:
            self.pending = Pending(self, lazy.waiting(self.store.extra))
        self._commit_seen = commit

    def _metrics(self, loss: Any, dt: float) -> dict:
        """The step's metrics (see :meth:`step`)."""
        stall = float(sum(e.stall for e in self.events))
        stall_idle = float(sum(e.stall_idle for e in self.events))
        c = self.clock
        return {"loss": float(loss), "step_time_s": dt, "stall_s": stall,
                "stall_idle_s": stall_idle, **c,
                "idle_s": stall + c["wait_update_s"] + c["wait_commit_s"],
                "device_idle_s": stall_idle + c["wait_update_idle_s"] + c["wait_commit_s"],
                "layers_read": sum(len(e.unit.layers) for e in self.events) - self._reused,
                **self.store.io.metrics(len({l for e in self.events for l in e.unit.layers})),
                **self.placement.metrics()}

    def estimate(self, batch: dict, key: jax.Array, step: int = 0) -> tuple[float, dict]:
        """The step's gradient estimate without updating: ``(loss, grads)``, grads shaped like
        params (skipped layers get zeros). For tests against the in-memory estimators. What it
        stages (pending lazy updates applied on read, scratch) is dropped: the store keeps its
        committed step."""
        key = self._checked(batch, key)
        out: dict = {}
        try:
            loss, _ = self._run(batch, key, self.layers(step),
                                lambda u, g, *a, **k: out.__setitem__(u, host_value(g)),
                                time.perf_counter(), commit_lazy=False)
        finally:
            self.store.abort()
        zeros = lambda u: jax.tree.map(np.zeros_like, self.store.read(u).result())
        blocks = [out.get(l) if l in out else zeros(l) for l in range(self.store.num_layers)]
        grads = {"embed": out["embed"], "head": out["head"],
                 "blocks": jax.tree.map(lambda *xs: np.stack(xs), *blocks)}
        return float(loss), grads

    def warm_up(self, batch: dict, key: jax.Array, step: int = 0) -> None:
        """Compiles what :meth:`step` runs, writing nothing: the step's sweeps (as
        :meth:`estimate`, whose staged writes are dropped) and the host optimizer update of each
        unit shape (on zero gradients, result discarded). So a run's first step is timed
        without compilation (a lazy update's first application still compiles then). Each
        unit's gradient is dropped as soon as it is handed over, unread: the warm-up holds no
        whole-model gradient (unlike :meth:`estimate`), so a model near the host's memory warms
        up as it trains, and nothing is read back until the sweeps' loss at the end."""
        key = self._checked(batch, key)
        try:
            loss, _ = self._run(batch, key, self.layers(step), lambda *a, **k: None,
                                time.perf_counter(), commit_lazy=False)
            jax.block_until_ready(loss)
        finally:
            self.store.abort()
        self.queue.warm_up(["embed", "head", *self.layers(step)[:1]])

    def forward(self, batch: dict, key: jax.Array, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The streamed forward sweep alone (no update): per micro-batch losses (N,) and
        directional derivatives (N, K) of the estimator's tangents for ``key``. Nothing it
        stages is kept."""
        key = self._checked(batch, key)
        n = jax.tree.leaves(batch)[0].shape[0]
        try:
            losses, d, *_ = forward_sweep(self, batch, jnp.stack([key] * n),
                                          list(self.layers(step)), time.perf_counter())
        finally:
            self.store.abort()
        return losses, d

    def close(self) -> None:
        """Waits for the host updates in flight and ends the host worker's thread (the store
        stays open: it is the caller's). A notebook or a sweep that builds many executors
        closes each when done instead of leaving an idle thread per executor until it is
        collected; a closed executor does not step again."""
        self._closed = True
        try:
            self.queue.shutdown()
        finally:
            self._end_loaders()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self, step: int | None = None) -> None:
        """Applies every pending lazy update and commits (before a checkpoint or evaluation)."""
        self._sync_pending()
        if not self.pending.apply_all():
            return
        self.store.commit(self.store.step if step is None else step,
                          extra={**self.store.extra, "pending": {}})
        self._commit_seen = (self.store.step, self.store.generation)
        self.placement.agree(self.store)

    # ------------------------------------------------------------------ the sweeps
    def _run(self, batch, key, layers, sink, t0, commit_lazy=True):
        plan = self.plan
        if plan.exact_subset:  # backprop of the selection
            batch = jax.tree.map(lambda a: np.asarray(a)[self._selection(key, len(a))], batch)
        if self.placement.merge_micro_batches(self.plan):
            batch = jax.tree.map(lambda a: jnp.reshape(a, (1, -1) + tuple(a.shape[2:])), batch)
        self.pending.applied, self._reused, self._resident = set(), 0, None
        loss, new = sweeps_of(plan)(self, batch, key, list(layers), sink, t0, commit_lazy)
        records = self.pending.merge(new) if commit_lazy else self.pending.records
        return loss, {"pending": lazy.pack(records, fresh=new, since=self.store.step)}

    def _keeping_last(self, layers: Sequence[int]) -> Callable:
        """:meth:`_load` that keeps the sweep's last block unit (host and device params) for
        the reverse sweep, which starts on it without reading it again."""
        units = self.placement.chunks(layers)
        last = units[-1] if units else None
        self._resident = None

        def load(u: Unit):
            if u != last:
                return self._load(u)
            hosts = self._block_hosts(u)
            dev = self.placement.put(u, hosts)
            self._resident = (u, hosts, dev)
            return None, dev
        return load

    def _load_both(self, unit: Unit) -> tuple[Any, Any]:
        """(host fp32 params — a list per layer for a block unit —, device params) of a unit."""
        if not unit.is_block:
            return self._load(unit)
        hosts = self._block_hosts(unit)
        return hosts, self.placement.put(unit, hosts)

    def _like(self, key: LayerKey, hosts: dict, staged: bool = False) -> Any:
        """Host params of a store address: the sweep's copy, else the store's."""
        return hosts[key] if key in hosts else self.store.read(key, staged=staged).result()

    # ------------------------------------------------------------------ helpers
    def _selection(self, key, n):
        return np.asarray(self.plan.select(n, key, self.store.num_layers)[0])
