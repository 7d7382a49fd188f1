"""The host-update queue of the streamed step: each unit's fp32 optimizer update and its
write run on one worker thread beside the next unit's compute (DESIGN §9).

Device arrays handed to it are materialised there, never on the main thread; at most
``in_flight`` units' host work is queued (one by default), so host memory holds that many
updates more, whatever the depth.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jaxstream.stream import kernels as K
from jaxstream.stream.idle import done_within, split_wait
from jaxstream.stream.store import LayerStore
from jaxstream.stream.sweeps.common import copying
from jaxstream.stream.units import LayerKey
from jaxstream.stream.values import host_value, on_host


def new_clock() -> dict:
    """The step's host-side time per cause (seconds)."""
    return {"host_update_s": 0.0, "wait_update_s": 0.0, "wait_update_idle_s": 0.0,
            "wait_write_s": 0.0, "wait_commit_s": 0.0}


class HostQueue:
    """One worker thread running the host's per-unit work in order.

    Args:
      store: where updates are staged.
      optimizer: the element-wise optax transformation (fp32, on the host).
      host: the CPU device the optimizer runs on.
      overlap: False runs each update in line (the same values, for comparison).
      in_flight: how many submitted pieces of work may wait or run before :meth:`submit`
        waits for the oldest (they run in order on the one worker either way).
      latest: returns the latest device values the main thread dispatched: a wait for the
        worker counts as idle (``wait_update_idle_s``) only once they are computed.

    Example::

        q = HostQueue(store, optax.sgd(0.1), jax.local_devices(backend="cpu")[0])
        q.update("embed", grads)   # returns at once; q.wait() raises the worker's error
    """

    def __init__(self, store: LayerStore, optimizer: Any, host: Any, overlap: bool = True,
                 latest: Callable[[], Any] | None = None, in_flight: int = 1):
        self.store, self.optimizer, self.host, self.overlap = store, optimizer, host, overlap
        self.in_flight = in_flight
        self.latest = latest
        self.clock = new_clock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="jaxstream-host-update")
        self._inflight: list[Future] = []

    def warm_up(self, units: list[LayerKey]) -> None:
        """Compiles the optimizer update of each unit's shape, on zero gradients (the result
        is discarded; nothing is staged)."""
        for u in units:
            params, opt = self.store.read(u).result(), self.store.read_opt(u).result()
            with on_host(self.host):
                zeros = jax.tree.map(lambda a: np.zeros(np.shape(a), np.float32), params)
                jax.block_until_ready(K.optax_step(self.optimizer, to_host(zeros, self.host),
                                                   opt, params))

    def update(self, unit: LayerKey, grads: Any, params: Any = None, opt: Any = None) -> None:
        """Hands one unit's update to the worker (after the one in flight) and returns."""
        if not self.overlap:
            t0 = time.perf_counter()
            self.apply_update(unit, grads, params, opt)
            self.clock["wait_update_s"] += time.perf_counter() - t0
            return
        self.submit(self.apply_update, unit, copying(grads), params, opt)

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Runs ``fn(*args)`` on the worker after the work queued before it; first waits until
        fewer than ``in_flight`` pieces are queued."""
        self.wait(keep=self.in_flight - 1)
        fut = self._worker.submit(fn, *args)
        self._inflight.append(fut)
        return fut

    def wait(self, keep: int = 0) -> None:
        """Waits for the work in flight, oldest first, until ``keep`` pieces are left (its
        errors raise here), timed as ``wait_update_s``."""
        t0 = time.perf_counter()
        try:
            while len(self._inflight) > keep:
                fut = self._inflight[0]
                _, idle = split_wait(lambda t, f=fut: done_within(f, t), self.latest)
                self.clock["wait_update_idle_s"] += idle
                fut.result()
                self._inflight.pop(0)
        finally:
            self.clock["wait_update_s"] += time.perf_counter() - t0

    def shutdown(self) -> None:
        """Waits for the work in flight, then ends the worker's thread."""
        try:
            self.wait()
        finally:
            self._worker.shutdown(wait=True)

    def drop(self) -> None:
        """After a failure: lets the work in flight finish, ignoring its errors."""
        for f in self._inflight:
            f.exception()
        self._inflight = []

    def apply_update(self, unit: LayerKey, grads: Any, params: Any = None,
                     opt: Any = None) -> None:
        """fp32 optax update of one unit on the host, then staged into the store."""
        if params is None:
            params = self.store.read(unit, staged=True).result()
        if opt is None:
            opt = self.store.read_opt(unit, staged=True).result()
        t0 = time.perf_counter()
        with on_host(self.host), jax.profiler.TraceAnnotation(f"host update {unit}"):
            new_p, new_opt = K.optax_step(self.optimizer, to_host(grads, self.host), opt, params)
            new = jax.tree.map(np.asarray, (new_p, new_opt))
        t1 = time.perf_counter()
        with jax.profiler.TraceAnnotation(f"write {unit}"):
            self.store.write(unit, *new)  # waits only while too many bytes are in flight
        self.clock["host_update_s"] += t1 - t0
        self.clock["wait_write_s"] += time.perf_counter() - t1

    def write_scratch(self, unit: LayerKey, tree: Any) -> Future:
        """``tree`` as fp32 into the unit's scratch, on the worker: a future of the write's
        futures."""
        copying(tree)
        return self.submit(lambda: self.store.write_scratch(unit, host32(tree)))

    def write_carry(self, unit: LayerKey, tree: Any, slot: int) -> Future:
        """``tree`` as fp32 into the unit's carry ``slot``, on the worker: a future of
        (futures, crcs)."""
        copying(tree)
        return self.submit(lambda: self.store.write_carry(unit, host32(tree), slot))


def host32(tree: Any) -> Any:
    """A pytree as fp32 NumPy values (waits for the device: a worker thread's job)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float32), host_value(tree))


def to_host(tree: Any, host: Any) -> Any:
    """A gradient pytree on the host device in one batched transfer (a no-op for arrays
    already there, as on a CPU backend); arrays spread over processes are gathered first.
    :func:`kernels.optax_step` casts it to fp32 inside its program."""
    if any(isinstance(a, jax.Array) and not a.is_fully_addressable
           for a in jax.tree.leaves(tree)):
        tree = host_value(tree)
    return jax.device_put(tree, host)
