"""Streamed layer-to-layer execution of one training step over a :class:`LayerStore`.

For l in the step's layers: wait for layer l (prefetched ``p`` ahead), cast it to the compute
dtype, put it on the device, apply it to *all* micro-batches (primal and tangents via jvp),
release it. Device memory holds (p + 1) layers plus the micro-batches' activations, whatever
the depth. The optimizer runs on the host in fp32 on the fp32 master copy:

* forward estimator: an eager update sweep re-streams the layers and forms each update from
  (key, scalars); or, lazily, the (key, scalars) record is committed with the step and applied
  when the layer is next read (see :mod:`jaxstream.stream.lazy`);
* hybrid: the selected micro-batches' layer inputs are stashed on the host, then a reverse
  sweep re-streams the layers and runs vjp for them (starting on the forward sweep's last
  unit, still resident: no read); ``replace`` updates during that sweep, ``control_variate``
  keeps each layer's exact mean gradient in the store's scratch space until the cross-layer
  scalars c_nk are complete, then updates in a third sweep — or, with ``update="lazy"``,
  commits it in the store's carry space with a :class:`~jaxstream.stream.deferred.Combine`
  record and applies the update when the layer is next read (two reads per layer per step);
* backprop: the reverse sweep with every micro-batch exact (the reference).

Every step ends with :meth:`LayerStore.commit`, so its writes become visible together.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.grad.checks import check_local_losses
from jaxstream.grad.plan import Plan
from jaxstream.grad.tangents import TangentSpec
from jaxstream.models.stack import Stack
from jaxstream.optim.promotion import standard_promotion
from jaxstream.stream import deferred, lazy
from jaxstream.stream import kernels as K
from jaxstream.stream.depth import DepthPolicy
from jaxstream.stream.placement import OneDevice, Placement
from jaxstream.stream.prefetch import Event, Prefetcher
from jaxstream.stream.readback import read_together
from jaxstream.stream.store import LayerStore
from jaxstream.stream.sweeps.activity import run_activity
from jaxstream.stream.sweeps.common import copying as _copying
from jaxstream.stream.sweeps.forward import forward_sweep, run_forward
from jaxstream.stream.sweeps.local_guess import run_local_guess
from jaxstream.stream.units import EMBED, HEAD, LayerKey, Unit, block, parse_key
from jaxstream.stream.values import host_value

DTYPES = ("float32", "bfloat16", "float16")
UPDATES = ("eager", "lazy")


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """Options of the streamed executor.

    Attributes:
      prefetch: p, layers read ahead of the one computing (0: no overlap).
      compute_dtype: dtype of parameters and activations on the device ("float32",
        "bfloat16", "float16"); the master copy and the optimizer stay fp32.
      update: "eager" (update sweep after the step) or "lazy" (apply each layer's update when
        it is next read: the forward estimator's (key, scalars), a hybrid's deferred combine;
        a hybrid with ``replace`` updates in its reverse sweep either way).
      depth: which layers each step runs (:class:`DepthPolicy`).
      overlap_update: run each unit's host update and write beside the next unit's compute
        (one update in flight); False runs it in line (the same values, for comparison).
      stash_bytes: device bytes for the block inputs a reverse sweep stashes (None: no
        limit); beyond it they spill to host memory, asynchronously (one device).
      async_commit: write and fsync each step's manifest on a thread while the next step
        computes (:meth:`LayerStore.commit` with ``wait=False``); the next step's first write
        waits for it, a failed one is raised by the next step before anything is written, and
        a kill before it lands resumes at the step before. ``store.settle()`` (or
        ``store.close()``) waits for the last one. False: every step returns committed.
    """

    prefetch: int = 2
    compute_dtype: str = "bfloat16"
    update: str = "eager"
    depth: DepthPolicy = dataclasses.field(default_factory=DepthPolicy)
    overlap_update: bool = True
    stash_bytes: int | None = None
    async_commit: bool = False

    def __post_init__(self):
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        if self.compute_dtype not in DTYPES:
            raise ValueError(f"compute_dtype must be one of {DTYPES}, got {self.compute_dtype!r}")
        if self.update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {self.update!r}")
        if self.stash_bytes is not None and (not isinstance(self.stash_bytes, int)
                                             or self.stash_bytes < 0):
            raise ValueError(f"stash_bytes must be None or an int >= 0, got {self.stash_bytes!r}")


RUNS = ("none", "weights", "activity", "local", "local_weights",  # the forward passes it runs
        "local_guess")  # (the local guess: on a placement that runs it, one device)

def plan_of(estimator: Any, update: str = "eager") -> Plan:
    """The estimator's plan, checked against what the streamed sweeps run; errors name it."""
    plan = getattr(estimator, "plan", None)
    if not isinstance(plan, Plan):
        raise TypeError("stream: estimator must be a jaxstream.grad estimator (one with a "
                        f".plan), got {type(estimator).__name__}")
    if plan.forward not in RUNS:
        raise ValueError(f"stream: {plan.describe()} needs a {plan.forward!r} forward pass, which "
                         f"the streamed sweeps do not run (they run {RUNS}); run it in memory or "
                         f"data parallel")
    if plan.mixes and plan.forward != "weights":
        raise TypeError(f"stream: estimator must be one that mixes exact gradients with weight "
                        f"tangents; got "
                        f"{type(estimator).__name__}, {plan.describe()}, which mixes them with "
                        f"a {plan.forward!r} forward pass (run it in memory or data parallel)")
    # lazy: the forward estimate's and a hybrid's update wait for the layer's next read;
    # backprop and exact subsets update in their reverse sweep either way (nothing to defer)
    if update == "lazy" and not (plan.forward == "none" or (
            plan.forward == "weights" and (plan.exact == "none" or plan.mixes))):
        raise ValueError("stream: update='lazy' needs the forward estimator with "
                         f"perturb='weights', a hybrid (an update described by keys, scalars "
                         f"and the hybrid's exact means) or backprop (updated in its reverse "
                         f"sweep either way), got {plan.describe()}")
    return plan


class StreamedExecutor:
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

        ex = StreamedExecutor(stack, jg.forward(), optax.adam(1e-3), store)
        metrics = ex.step(micro_batched_batch, key)   # leaves (N, B, ...)
    """

    def __init__(self, stack: Stack, estimator: Any, optimizer: Any, store: LayerStore,
                 config: StreamConfig = StreamConfig(), device: Any = None,
                 placement: Placement | None = None):
        if store.num_layers != stack.num_layers:
            raise ValueError(f"store has {store.num_layers} layers, the model {stack.num_layers}")
        self.plan = plan_of(estimator, config.update)
        check_local_losses(stack, self.plan.forward in ("local", "local_weights"), "stream")
        self.stack, self.estimator, self.store, self.cfg = stack, estimator, store, config
        self.optimizer = standard_promotion(optimizer)  # optax's arithmetic: optax's rules
        self.spec: TangentSpec = self.plan.spec
        self.host = jax.local_devices(backend="cpu")[0]
        self.dtype = jnp.dtype(config.compute_dtype)
        self.placement = placement or OneDevice(stack, self.spec, self.dtype,
                                                device or jax.local_devices()[0],
                                                config.stash_bytes)
        self.placement.agree(store)
        if self.plan.forward == "local_guess" and not self.placement.runs_local_guess:
            raise ValueError(f"{type(self.placement).__name__}: the local guess's sweeps (exact "
                             "local gradients, then one jvp along them) run on one device "
                             "(the stream engine), not on this placement; run it there or in "
                             "memory")
        self.events: list[Event] = []
        self.clock = _clock()  # the last step's time per cause
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="jaxstream-host-update")
        self._inflight: list[Future] = []
        self._pending: dict = dict(store.extra.get("pending", {}))
        self._applied: set = set()
        self._carried: dict = {}  # this step's deferred h_u: unit -> (carry slot, crcs)
        self._resident: tuple | None = None  # (unit, hosts, device params) kept for the reverse
        self._reused = 0  # layers the reverse sweep took from the forward sweep (no read)

    # ------------------------------------------------------------------ loading
    def _to_device(self, tree: Any) -> Any:
        return self.placement.to_device(tree)

    def _apply_pending(self, unit: LayerKey, params: Any) -> Any:
        """Applies the lazy records of store address ``unit`` (host, fp32) and stages the
        result (a step's commit makes it visible; :meth:`estimate` and :meth:`forward` drop
        it)."""
        recs = lazy.take(self._pending, unit)
        if not recs:
            return params
        opt = self.store.read_opt(unit).result()
        with jax.default_device(self.host):
            for rec in recs:
                if deferred.is_combine(rec):
                    g = _f32(self._combined(unit, params, self.store.read_carry(
                        unit, rec["slot"], rec["crc"]).result(), self._record(rec)), self.host)
                else:
                    key, coeffs = lazy.decode(rec)
                    g = K.unit_estimate(self.spec, K.step_seg_keys(key, unit), coeffs, params)
                params, opt = K.optax_step(self.optimizer, g, opt, params)
            params, opt = jax.tree.map(np.asarray, (params, opt))
        self.store.write(unit, params, opt)
        self._applied.add(str(unit))
        return params

    def _record(self, rec: dict) -> deferred.Combine:
        """A pending combine record, refused by name unless this estimator's rule wrote it."""
        c = deferred.Combine.decode(rec)
        if c.rule != self.plan.rule.name:
            raise ValueError(f"stream: the store holds pending updates of a hybrid with combine "
                             f"rule {c.rule!r}; this estimator's rule is {self.plan.rule.name!r}. "
                             "Apply them first (flush()) with the estimator that wrote them")
        return c

    def _combined(self, unit: LayerKey, params: Any, h: Any, c: deferred.Combine) -> Any:
        """``unit``'s estimate under the plan's rule from its group mean ``h`` and the step's
        :class:`~jaxstream.stream.deferred.Combine` (the eager update sweep and a deferred
        update both form it here, from the same inputs)."""
        with jax.default_device(self.host):
            st = {**c.common(), "h": h, "member": c.member(unit)}
            if c.scale is not None:
                st["direction"] = jax.tree.map(lambda a: np.asarray(a) * np.float32(c.scale), h)
            return K.unit_combine(self.plan.rule, self.spec, K.seg_keys(c.keys, unit), c.d,
                                  params, st, c.totals)

    def _block_hosts(self, unit: Unit, staged: bool = False) -> list:
        """Host params of each layer of a block unit (lazy updates applied unless ``staged``:
        the reverse sweep reads what this step staged)."""
        layers = unit.layers
        futures = [self.store.read(l, staged=staged) for l in layers]
        hosts = [f.result() for f in futures]
        return hosts if staged else [self._apply_pending(l, h) for l, h in zip(layers, hosts)]

    def _load(self, unit: Unit) -> tuple[Any, Any]:
        """(host params of the embed / head, or None for a block unit; device params)."""
        if not unit.is_block:
            host = self._apply_pending(unit.key, self.store.read(unit.key).result())
            return host, self._to_device(host)
        return None, self.placement.put(unit, self._block_hosts(unit))

    def _units(self, layers: Sequence[int]) -> list[Unit]:
        """A sweep's units: the embed, the placement's block units of ``layers``, the head."""
        return [EMBED, *self.placement.chunks(layers), HEAD]

    def _sweep(self, units: Sequence[Unit], load: Callable, t0: float, name: str,
               fence: Callable | None = None):
        pf = Prefetcher(load, units, self.cfg.prefetch, t0, name, fence)
        for item in pf:
            self.placement.progress()
            yield item
        self.events.extend(pf.events)

    def _drive(self, layers: Sequence[int], load: Callable, t0: float, name: str,
               end: Callable, blocks: Callable, done: Callable | None = None,
               state: Any = None, reverse: bool = False) -> Any:
        """One embed → blocks → head sweep over ``layers`` (head → blocks → embed with
        ``reverse``), the one driver of every sweep: ``end(unit, loaded, state)`` runs the
        embed and the head, ``blocks(unit, loaded, state)`` a block unit, each returning
        ``(state, done)``; before the last unit the placement lands the blocks' pass
        (:meth:`Placement.land`). ``done(list of (unit, gradient))`` receives the gradients as
        they complete. Returns the last unit's state."""
        units = self._units(layers)
        last = units[0] if reverse else units[-1]
        latest = [state]  # what the loads wait for: the device runs ahead by the prefetch depth
        for u, loaded in self._sweep(units[::-1] if reverse else units, load, t0, name,
                                     lambda: latest[0]):
            with jax.profiler.TraceAnnotation(f"{name} {u}"):
                state, finished = self._unit(u, loaded, state, blocks, end, done, last)
            latest[0] = state
            if done is not None:
                done(finished)
        return state

    def _unit(self, u: Unit, loaded: Any, state: Any, blocks: Callable, end: Callable,
              done: Callable | None, last: Unit) -> tuple:
        """One unit of :meth:`_drive`: ``(state, finished)``."""
        if u.is_block:
            return blocks(u, loaded, state)
        if u == last:
            state, landed = self.placement.land(state)
            if done is not None:
                done(landed)
        return end(u, loaded, state)

    def _cast_batch(self, batch: dict) -> dict:
        return self.placement.cast_batch(batch)

    # ------------------------------------------------------------------ updates
    def _update(self, unit: LayerKey, grads: Any, params: Any = None, opt: Any = None) -> None:
        """Hands one unit's update to the host worker and returns: the update and its write
        overlap the next unit's compute. At most one update is in flight (the previous one is
        waited for first), so host memory holds one unit's update more, whatever the depth."""
        if not self.cfg.overlap_update:
            t0 = time.perf_counter()
            self._apply_update(unit, grads, params, opt)
            self.clock["wait_update_s"] += time.perf_counter() - t0
            return
        self._submit(self._apply_update, unit, _copying(grads), params, opt)

    def _submit(self, fn: Callable, *args: Any) -> Future:
        """Runs ``fn(*args)`` on the host worker after the work in flight (waited for first,
        so one unit's host work is in flight beside the device): device arrays among the
        arguments are materialised there, never on the main thread."""
        self._wait_updates()
        fut = self._worker.submit(fn, *args)
        self._inflight.append(fut)
        return fut

    def _wait_updates(self) -> None:
        """Waits for the updates in flight (their errors raise here), timed as
        ``wait_update_s``."""
        t0 = time.perf_counter()
        try:
            while self._inflight:
                self._inflight[0].result()
                self._inflight.pop(0)
        finally:
            self.clock["wait_update_s"] += time.perf_counter() - t0

    def _drop_updates(self) -> None:
        """After a failure: lets every update in flight finish (nothing is written after the
        step is aborted), ignoring their errors."""
        for f in self._inflight:
            f.exception()
        self._inflight = []

    def _apply_update(self, unit: LayerKey, grads: Any, params: Any = None,
                      opt: Any = None) -> None:
        """fp32 optax update of one unit on the host, then staged into the store."""
        if params is None:
            params = self.store.read(unit, staged=True).result()
        if opt is None:
            opt = self.store.read_opt(unit, staged=True).result()
        t0 = time.perf_counter()
        with jax.default_device(self.host), jax.profiler.TraceAnnotation(f"host update {unit}"):
            grads = _f32(grads, self.host)
            new_p, new_opt = K.optax_step(self.optimizer, grads, opt, params)
            new = jax.tree.map(np.asarray, (new_p, new_opt))
        t1 = time.perf_counter()
        with jax.profiler.TraceAnnotation(f"write {unit}"):
            self.store.write(unit, *new)  # waits only while too many bytes are in flight
        self.clock["host_update_s"] += t1 - t0
        self.clock["wait_write_s"] += time.perf_counter() - t1

    def _write_scratch(self, unit: LayerKey, tree: Any) -> list:
        """(Host worker) ``tree`` as fp32 into the unit's scratch: the write's futures."""
        return self.store.write_scratch(unit, _host32(tree))

    def _write_carry(self, unit: LayerKey, tree: Any, slot: int) -> tuple:
        """(Host worker) ``tree`` as fp32 into the unit's carry ``slot``: (futures, crcs)."""
        return self.store.write_carry(unit, _host32(tree), slot)

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
          metrics: loss, ``step_time_s``, and the main thread's idle time per cause:
          ``stall_s`` (waiting for a layer's read), ``wait_update_s`` (waiting for the host
          worker — optimizer updates and scratch writes — which runs beside the sweeps:
          ``host_update_s`` is its total, mostly overlapped, ``wait_write_s`` the part of it
          spent waiting for staged writes past ``max_write_bytes``), ``wait_commit_s`` (the
          commit: the step's writes, then the manifest written and fsynced), ``idle_s``
          (stall, update and commit waits summed: the rest of the step is the main thread's
          dispatch and host work); ``layers_read``; a
          placement's own (ticks). The main thread never waits for the device: it reads the
          step's few scalars (loss, directional derivatives, a selection) once.
        """
        at = self.store.step
        step = at if step is None else int(step)
        t0 = time.perf_counter()
        self.events = []
        self.clock = _clock()
        self.placement.begin_step()
        pending = {k: list(v) for k, v in self._pending.items()}
        try:
            with jax.profiler.StepTraceAnnotation("stream_step", step_num=step):
                loss, run_extra = self._run(batch, key, self.layers(step), self._update, t0)
                if callable(extra):
                    extra = extra(float(loss))
                self._wait_updates()
                tc = time.perf_counter()
                with jax.profiler.TraceAnnotation("commit"):
                    self.store.commit(step + 1, extra={**self.store.extra, **run_extra,
                                                       **(extra or {})},
                                      wait=not self.cfg.async_commit)
                self.clock["wait_commit_s"] += time.perf_counter() - tc
        except BaseException as e:
            self._drop_updates()
            self._pending = pending  # a failed step leaves no trace: a retry redoes it exactly
            self.store.abort()
            if self.store.step != at:  # the step before did not land (async_commit)
                self._pending = dict(self.store.extra.get("pending", {}))
            self.placement.end_step(e)
            raise
        self.placement.agree(self.store)  # the copies committed the same step, or this raises
        self.placement.end_step()
        dt = time.perf_counter() - t0
        stall = float(sum(e.stall for e in self.events))
        return {"loss": float(loss), "step_time_s": dt, "stall_s": stall, **self.clock,
                "idle_s": stall + self.clock["wait_update_s"] + self.clock["wait_commit_s"],
                "layers_read": sum(len(e.unit.layers) for e in self.events) - self._reused,
                **self.placement.metrics()}

    def estimate(self, batch: dict, key: jax.Array, step: int = 0) -> tuple[float, dict]:
        """The step's gradient estimate without updating: ``(loss, grads)``, grads shaped like
        params (skipped layers get zeros). For tests against the in-memory estimators. What it
        stages (pending lazy updates applied on read, scratch) is dropped: the store keeps its
        committed step."""
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
        without compilation (a lazy update's first application still compiles then)."""
        self.estimate(batch, key, step)
        layers = self.layers(step)
        for u in ["embed", "head", *layers[:1]]:
            params = self.store.read(u).result()
            opt = self.store.read_opt(u).result()
            with jax.default_device(self.host):
                zeros = jax.tree.map(lambda a: np.zeros(np.shape(a), np.float32), params)
                jax.block_until_ready(K.optax_step(self.optimizer, _f32(zeros, self.host), opt,
                                                   params))

    def forward(self, batch: dict, key: jax.Array, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """The streamed forward sweep alone (no update): per micro-batch losses (N,) and
        directional derivatives (N, K) of the estimator's tangents for ``key``. Nothing it
        stages is kept."""
        n = jax.tree.leaves(batch)[0].shape[0]
        try:
            losses, d, *_ = forward_sweep(self, batch, jnp.stack([key] * n),
                                          list(self.layers(step)), time.perf_counter())
        finally:
            self.store.abort()
        return losses, d

    def flush(self, step: int | None = None) -> None:
        """Applies every pending lazy update and commits (before a checkpoint or evaluation)."""
        if not any(self._pending.values()):
            return
        self._applied = set()
        for unit in [parse_key(u) for u, r in self._pending.items() if r]:
            self._apply_pending(unit, self.store.read(unit).result())
        self._pending = {}
        self.store.commit(self.store.step if step is None else step,
                          extra={**self.store.extra, "pending": {}})
        self.placement.agree(self.store)

    # ------------------------------------------------------------------ the sweeps
    def _run(self, batch, key, layers, sink, t0, commit_lazy=True):
        plan = self.plan
        if plan.forward == "none" and plan.exact == "selected":  # backprop of the selection
            batch = jax.tree.map(lambda a: np.asarray(a)[self._selection(key, len(a))], batch)
        if self.placement.merge_micro_batches(self.plan):
            batch = jax.tree.map(lambda a: jnp.reshape(a, (1, -1) + tuple(a.shape[2:])), batch)
        self._applied, self._reused, self._resident = set(), 0, None
        if plan.forward == "weights" and plan.exact == "none":
            loss, new = run_forward(self, batch, key, list(layers), sink, t0, commit_lazy)
        elif plan.local:
            loss, new = run_activity(self, batch, key, list(layers), sink, t0), {}
        elif plan.forward == "local_guess":
            loss, new = run_local_guess(self, batch, list(layers), sink, t0), {}
        else:
            loss, new = self._run_reverse(batch, key, list(layers), sink, t0, commit_lazy)
        if commit_lazy:
            # records applied this step are gone; skipped layers keep theirs; new ones appended
            self._pending = {k: v for k, v in self._pending.items() if k not in self._applied and v}
            for k, v in new.items():
                self._pending.setdefault(k, []).extend(v)
        return loss, {"pending": self._pending}

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

    @staticmethod
    def _unit_grad(u: Unit, out: tuple) -> tuple:
        """``((h,), [(u, gradient)])`` from an embed / head kernel's ``(h, gradient)``."""
        h, g = out
        return (h,), [(u, g)]

    def _like(self, key: LayerKey, hosts: dict, staged: bool = False) -> Any:
        """Host params of a store address: the sweep's copy, else the store's."""
        return hosts[key] if key in hosts else self.store.read(key, staged=staged).result()

    def _run_reverse(self, batch, key, layers, sink, t0, commit_lazy=False):
        """The reverse sweep: exact gradients of every micro-batch (backprop, exact subsets) or
        of the selected ones, each unit's estimate formed by the plan's combine rule — in the
        sweep itself, or (a rule that needs every unit's share, or a direction) in an update
        sweep after it; with ``update="lazy"`` that update is deferred to each unit's next
        read (returned as pending records; h_u in the store's carry space)."""
        n = jax.tree.leaves(batch)[0].shape[0]
        mixes, rule = self.plan.mixes, self.plan.rule
        if mixes:  # the selection, its depths and the key's data: one transfer
            idx, depth, key_data = read_together((*self.plan.select(
                n, key, self.store.num_layers), jax.random.key_data(key)))
            keys = K.micro_keys(key, n)
            losses, d, hosts, stash, x, _ = forward_sweep(self, batch, keys, layers, t0, idx)
        else:
            idx, keys, d = np.arange(n), None, None
            losses, hosts, stash, x = self._plain_sweep(batch, layers, t0)
        sel = jax.tree.map(lambda a: a[idx], x)
        later = mixes and (rule.cross or rule.along)  # estimates wait for every unit's share
        defer = later and commit_lazy and self.cfg.update == "lazy"
        self._carried = {}  # unit -> (carry slot, crc32c per leaf) of its h_u (deferred)
        partials: list = []  # each unit's share of the rule's sums (device values)
        sq: list = []  # ‖h_u‖² per unit (a direction's norm), device scalars
        tasks: dict = {}  # unit -> (carry slot or None, the host worker's write of its h_u)
        # what every unit's combine shares (the totals, and the d of a direction, come later)
        c = deferred.Combine.of(rule=rule.name, key=key, n=n, d=d, totals={}, idx=idx,
                                depth=depth, total_size=self._total_size(layers, hosts),
                                key_data=key_data) if mixes else None
        common = c.common() if mixes else {}

        def finish(u, g, p):
            """g: per selected micro-batch gradients (mixes) or the mean gradient (backprop),
            device values: reduced there, handed to the host worker as they are."""
            if not mixes:
                return sink(u, g, p)
            est, h_u, part, sq_u = K.unit_share(rule, self.spec, K.shapes(p), bool(later), g,
                                                c.member(u), K.seg_keys(keys, u), d, common)
            if not later:
                return sink(u, est, p)
            partials.append(part)
            sq.append(sq_u)
            if defer:
                slot = deferred.carry_slot(self._pending, u)
                tasks[u] = (slot, self._submit(self._write_carry, u, _copying(h_u), slot))
            else:
                tasks[u] = (None, self._submit(self._write_scratch, u, _copying(h_u)))

        head_losses = self._reverse_sweep(layers, hosts, stash, sel, mixes, finish, t0)
        if not mixes:
            losses = head_losses

        if later:
            for u, (slot, task) in tasks.items():  # every h_u written (a failed write raises)
                futs, crcs = task.result() if defer else (task.result(), None)
                for f in futs:
                    f.result()
                if defer:
                    self._carried[u] = (slot, crcs)
            totals, sq_sum = read_together((K.total(partials), K.total(sq)))  # one transfer
            scale = None
            if rule.along:  # a forward sweep along u = h / ‖h‖ gives d_n = ∇L_n·u
                scale = 1.0 / max(float(np.sqrt(sq_sum)), 1e-30)
                d = self._along_sweep(batch, layers, hosts, t0, scale)[:, None]
            c = dataclasses.replace(c, d=np.asarray(d, np.float32), scale=scale,
                                    totals={k: np.asarray(v) for k, v in totals.items()})
            if defer:
                return float(np.mean(losses)), {
                    str(u): [c.encode(*self._carried[u])] for u in ["embed", *layers, "head"]}
            self._combine_sweep(layers, hosts, sink, t0, c)
        return float(np.mean(losses)), {}

    def _reverse_sweep(self, layers, hosts, stash, sel, mixes, finish, t0):
        """Head → blocks → embed on the driver: each unit's exact gradients (per selected
        micro-batch with ``mixes``, else their mean) handed to ``finish(address, gradient,
        host params)``. The head and embed are the forward sweep's copies; blocks are read as
        staged. Returns the head's per-example losses (mean gradients) or None."""
        h_in = self.placement.bring(stash["head"])
        s = jax.tree.leaves(sel)[0].shape[0]
        rhosts: dict = {}
        out: list = [None]

        def rload(u: Unit) -> tuple[Any, Any]:
            if u.is_block and self._resident is not None and self._resident[0] == u:
                _, hosts_u, dev = self._resident  # the forward sweep's last unit: no read
                self._resident = None
                self._reused += len(u.layers)
                return hosts_u, dev
            if u.is_block:
                return self._rload(u)
            return hosts[u.key], self._to_device(hosts[u.key])

        def end(u, loaded, state):
            rhosts[u] = loaded[0]
            if u == HEAD:
                if mixes:
                    _, g, ct = K.head_vjp_each(self.stack, loaded[1], h_in, sel)
                else:
                    head_losses, g, ct = K.head_loss_vjp(self.stack, loaded[1], h_in, sel,
                                                         jnp.full((s,), 1.0 / s, jnp.float32))
                    out[0] = head_losses  # read when the sweep is done
                return (ct,), [(u, g)]
            (ct,) = state
            g = (K.embed_vjp_each if mixes else K.embed_vjp)(self.stack, loaded[1], sel["x"], ct)
            return state, [(u, g)]

        def blocks(u, loaded, state):
            rhosts[u] = loaded[0]
            return self.placement.vjp(loaded[1], u, stash, state, mixes)

        def done(finished):
            for v, g in finished:
                self._each(v, g, rhosts.pop(v), finish)

        self._drive(layers, rload, t0, "reverse", end, blocks, done, reverse=True)
        return None if out[0] is None else host_value(out[0])

    def _total_size(self, layers: Sequence[int], hosts: dict) -> float:
        """The model's parameter count (a combine rule's shrinkage reads it)."""
        size = lambda u: float(sum(np.size(a) for a in jax.tree.leaves(self._like(u, hosts))))
        return size("embed") + size("head") + (size(layers[0]) * self.store.num_layers
                                               if layers else 0.0)

    def _combine_sweep(self, layers, hosts, sink, t0, c: deferred.Combine) -> None:
        """The update sweep of a rule that waits for every unit: each unit's estimate from its
        group mean h_u (the store's scratch) and the step's scalars ``c``."""

        def uload(u: Unit):
            p = self._like(u.key, hosts, staged=True)
            return p, self._combined(u.key, p, self._read_h(u.key), c)

        units = [EMBED, *map(block, layers), HEAD]
        for u, (p, g) in self._sweep(units, uload, t0, "update"):
            sink(u.key, g, p)

    def _along_sweep(self, batch, layers, hosts, t0, scale: float) -> np.ndarray:
        """A forward sweep along u = h · ``scale`` (h from the store's scratch): each
        micro-batch's derivative ∇L_n·u, (N,)."""
        x = self._cast_batch(batch)

        def gload(u: Unit):
            if not u.is_block:
                dev = self._to_device(hosts[u.key])
                v = jax.tree.map(lambda a: np.asarray(a) * scale, self._read_h(u.key))
                return dev, self._to_device(v)
            return self._load_along(u, scale)

        def end(u, loaded, state):
            dev, v = loaded
            if u == EMBED:
                return K.embed_along(self.stack, dev, v, x["x"]), []
            return K.head_along(self.stack, dev, v, *state, x), []

        _, dg = self._drive(layers, gload, t0, "guess", end, lambda u, loaded, st: (
            self.placement.along(loaded[0], u, loaded[1], st), []))
        return np.asarray(host_value(dg), np.float32)

    # ------------------------------------------------------------------ units
    def _done(self, done: list, hosts: dict, sink: Callable) -> None:
        """Sinks the gradients a placement completed (fp32, on the host), one per layer."""
        for u, g in done:
            self._each(u, g, hosts.pop(u), sink)

    def _each(self, u: Unit, g: Any, host: Any, fn: Callable) -> None:
        """``fn(store address, gradient, host params)`` for each layer of unit ``u`` (the
        embed's and the head's own)."""
        if not u.is_block:
            return fn(u.key, g, host)
        self.placement.split(u, g, host, fn)

    def _rload(self, u: Unit) -> tuple[Any, Any]:
        """(host, device) params of a unit as staged this step (the reverse sweep)."""
        if not u.is_block:
            host = self.store.read(u.key, staged=True).result()
            return host, self._to_device(host)
        hosts = self._block_hosts(u, staged=True)
        return hosts, self.placement.put(u, hosts)

    def _load_along(self, u: Unit, scale: float) -> tuple[Any, Any]:
        """(device params, device direction) of a block unit for the ``guess`` sweep."""
        dev = self.placement.put(u, self._block_hosts(u))
        vs = [jax.tree.map(lambda a: np.asarray(a) * scale, self._read_h(l)) for l in u.layers]
        return dev, self.placement.put(u, vs)

    def _read_h(self, addr: LayerKey) -> Any:
        """A unit's group mean h_u of this step: from the carry space where it was deferred,
        else the scratch space."""
        if addr in self._carried:
            return self.store.read_carry(addr, *self._carried[addr]).result()
        return self.store.read_scratch(addr).result()

    # ------------------------------------------------------------------ helpers
    def _selection(self, key, n):
        return np.asarray(self.plan.select(n, key, self.store.num_layers)[0])

    def _plain_sweep(self, batch, layers, t0):
        """Forward sweep without tangents, stashing every block's input (backprop)."""
        x = self._cast_batch(batch)
        stash, hosts = {}, {}

        def end(u, loaded, state):
            hosts[u.key], dev = loaded
            if u == EMBED:
                return (K.embed_apply(self.stack, dev, x["x"]),), []
            stash["head"] = self.placement.keep(state[0])
            return None, []

        self._drive(layers, self._keeping_last(layers), t0, "forward", end,
                    lambda u, loaded, st: (self.placement.apply(loaded[1], u, st, stash), []))
        return None, hosts, stash, x


def _clock() -> dict:
    return {"host_update_s": 0.0, "wait_update_s": 0.0, "wait_write_s": 0.0,
            "wait_commit_s": 0.0}


def _host32(tree: Any) -> Any:
    """A pytree as fp32 NumPy values (waits for the device: a worker thread's job)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float32), host_value(tree))


def _f32(tree: Any, host: Any) -> Any:
    """A gradient pytree as fp32 on the host (the optimizer's precision)."""
    return jax.tree.map(lambda a: jax.device_put(np.asarray(host_value(a), np.float32), host),
                        tree)
