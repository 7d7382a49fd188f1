"""Prefetcher: loads units (layers) ``depth`` ahead of the one being computed.

Each load runs on a worker thread: the TensorStore read (itself asynchronous), host-side
preparation (a pending lazy update, the cast to the compute dtype) and the host->device copy.
The consumer only waits when a load is late; that wait is the *stall* time, recorded per unit
with the read and compute intervals so a timeline of reads against compute can be drawn.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.stream.direct_read import BUFFERS
from jaxstream.stream.idle import done_within, split_wait


class Event(NamedTuple):
    """One unit's timeline (seconds since the step began)."""

    unit: Any
    load_start: float
    load_end: float
    compute_start: float
    stall: float
    sweep: str
    stall_idle: float = 0.0  # the part of ``stall`` the device had nothing to compute


class Prefetcher:
    """Iterates ``(unit, value)`` over ``order``, loading ``depth`` units ahead.

    Args:
      load: ``unit -> value`` (runs on a worker thread).
      order: the units in execution order.
      depth: how many units are in flight beyond the current one (p >= 0; 0 = no overlap).
      t0: the step's start time (``time.perf_counter()``), for the timeline.
      sweep: a label for the events ("forward", "reverse", "update").
      fence: called on the consumer's thread when a load is queued; the loading thread waits
        for the device values it returns (the latest unit's outputs) before it loads, so the
        device holds at most ``depth + 1`` units beyond the one computing while the consumer
        itself never waits for the device.
      pool: the threads to load on (at least ``depth`` workers), kept by the caller across
        sweeps so no sweep starts and joins threads of its own; None: a pool for this
        iteration only. Either way every load queued has ended when the iteration does.

    Example::

        for l, layer in Prefetcher(lambda l: store.read(l).result(), range(L), 2, t0):
            h = block(layer, h)
    """

    def __init__(self, load: Callable[[Any], Any], order: Sequence[Any], depth: int,
                 t0: float | None = None, sweep: str = "forward",
                 fence: Callable[[], Any] | None = None, pool: ThreadPoolExecutor | None = None):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self._load, self._order, self._depth = load, list(order), int(depth)
        self._t0 = time.perf_counter() if t0 is None else t0
        self._sweep = sweep
        self._fence = fence
        self._pool = pool
        self.events: list[Event] = []

    def _timed(self, unit: Any, fence: Any = None) -> tuple[Any, float, float]:
        if fence is not None:
            jax.block_until_ready(fence)
        start = time.perf_counter() - self._t0
        with jax.profiler.TraceAnnotation(f"read {self._sweep} {unit}"):
            value = self._load(unit)
        return value, start, time.perf_counter() - self._t0

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if not self._order:
            return
        if self._pool is not None:
            yield from self._run(self._pool)
            return
        with ThreadPoolExecutor(max_workers=max(1, self._depth)) as pool:
            yield from self._run(pool)

    def _run(self, pool: ThreadPoolExecutor) -> Iterator[tuple[Any, Any]]:
        pending: deque[tuple[Any, Future]] = deque()
        it = iter(self._order)

        def submit() -> None:
            u = next(it, _END)
            if u is not _END:
                fence = self._fence() if self._fence is not None else None
                pending.append((u, pool.submit(self._timed, u, fence)))

        try:
            for _ in range(max(1, self._depth)):
                submit()
            while pending:
                unit, fut = pending.popleft()
                wait0 = time.perf_counter()
                _, idle = split_wait(lambda t, f=fut: done_within(f, t), self._fence)
                value, start, end = fut.result()
                stall = time.perf_counter() - wait0
                if self._depth > 0:
                    submit()
                compute_start = time.perf_counter() - self._t0
                self.events.append(Event(unit, start, end, compute_start, stall, self._sweep,
                                         idle))
                yield unit, value
                if self._depth == 0:
                    submit()
        finally:  # a sweep left early (an error): its loads end before anything else runs
            wait([f for _, f in pending])

    @property
    def stall(self) -> float:
        """Total time the consumer waited for loads."""
        return float(sum(e.stall for e in self.events))


_END = object()


def to_device(tree: Any, dtype: Any, device: Any) -> Any:
    """Puts a host pytree on ``device``, floating leaves cast to ``dtype`` (one ``device_put``).

    A cast writes into a reused 64-byte aligned buffer (:data:`BUFFERS`), which the CPU client
    aliases instead of copying once more; leaves already in ``dtype`` (and aligned, as the
    store's reads are) go as they are.

    Example::

        dev = to_device(store.read(l).result(), jnp.bfloat16, jax.devices()[0])
    """
    dtype = np.dtype(dtype)

    def cast(a: Any) -> Any:
        if isinstance(a, jax.Array):  # already a device value: cast there, never read back
            floating = jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != dtype
            return a.astype(dtype) if floating else a
        a = np.asarray(a)
        if not np.issubdtype(a.dtype, np.floating) or a.dtype == dtype:
            return a
        out = BUFFERS.take(a.size * dtype.itemsize).view(dtype).reshape(a.shape)
        np.copyto(out, a, casting="unsafe")
        return out

    return jax.device_put(jax.tree.map(cast, tree), device)
