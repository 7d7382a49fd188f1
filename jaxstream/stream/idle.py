"""Whether the device was busy while the main thread waited: a wait split into the part the
device was still computing the work already dispatched (not idle: the step is bound by that
compute) and the part it had nothing to do (idle, charged to what was waited for).

The main thread polls: it waits in short slices and checks, between slices, whether the latest
dispatched values are ready (:meth:`jax.Array.is_ready`, which never blocks). So a step's
idle per cause sums device-idle time only, and the excess over the in-memory step that these
causes leave is what the device spent beyond the in-memory step's compute (dispatch, smaller
kernels) — never a wait counted twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import jax

SLICE_S = 5e-4  # the polling slice: a wait's split is exact to about this


def ready(values: Any) -> bool:
    """True when every device array among ``values`` is computed (non-blocking)."""
    return all(a.is_ready() for a in jax.tree.leaves(values) if isinstance(a, jax.Array))


def split_wait(wait: Callable[[float], bool], latest: Callable[[], Any] | None) -> tuple[float, float]:
    """Calls ``wait(timeout)`` until it returns True; returns ``(busy_s, idle_s)``: the time
    until the values ``latest()`` returns were ready (the device computing), and the rest."""
    t0 = time.perf_counter()
    values = latest() if latest is not None else None
    t_ready = t0 if values is None or ready(values) else None
    while not wait(SLICE_S if t_ready is None else None):
        if t_ready is None and ready(values):
            t_ready = time.perf_counter()
    t1 = time.perf_counter()
    busy = (t_ready if t_ready is not None else t1) - t0
    return busy, t1 - t0 - busy


def done_within(fut: Future, timeout: float | None) -> bool:
    """Waits up to ``timeout`` seconds for ``fut`` (None: until it is done); whether it is."""
    return bool(wait([fut], timeout=timeout).done)
