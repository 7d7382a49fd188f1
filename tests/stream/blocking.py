"""A counter of blocking device→host materialisations on the main thread (DESIGN §9).

On the CPU backend ``jax.transfer_guard`` does not fire (CPU arrays are host memory), so the
count is taken from outside the code under test: every way a device array becomes a host
value (``np.asarray`` / ``np.array``, ``float``, ``int``, ``bool``, ``.item()``, ``.tolist()``, iteration,
``block_until_ready``, ``_value``, ``jax.device_get``, ``jax.block_until_ready``) is wrapped,
and the outermost call on the main thread counts once per array. Worker threads (the host
optimizer, the writer, the prefetcher) are free to materialise: that is where the copy
belongs.

Example::

    with count_blocking() as c:
        ex.step(batch, key)
    assert c.total <= 4
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax._src.array import ArrayImpl

# On the CPU backend NumPy reads a device array through the buffer protocol, a C slot that
# cannot be wrapped: NumPy's array constructors are wrapped instead (``jax.tree.map(np.asarray,
# tree)`` and ``np.asarray(x)`` count; a ufunc applied to a device array does not).
NUMPY = ("asarray", "array", "asanyarray", "ascontiguousarray")
METHODS = ("__array__", "__float__", "__int__", "__bool__", "__index__", "__complex__", "item",
           "tolist", "__iter__", "block_until_ready")


class Counter:
    """Counts per entry point (``by``) and where they came from (``sites``)."""

    def __init__(self) -> None:
        self.by: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()
        self._depth = threading.local()

    @property
    def total(self) -> int:
        return sum(self.by.values())

    def enter(self, name: str, arrays: int = 1) -> bool:
        """Records one materialisation of ``arrays`` arrays if this is the outermost call on
        the main thread; returns whether it did (the caller then calls :meth:`leave`)."""
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if depth == 0 and threading.current_thread() is threading.main_thread() and arrays:
            self.by[name] += arrays
            self.sites[_site()] += arrays
        return True

    def leave(self) -> None:
        self._depth.n -= 1


def _site() -> str:
    """The first frame of jaxstream's own code that asked (file:line)."""
    import traceback

    for fr in reversed(traceback.extract_stack()[:-3]):
        if "/jaxstream/" in fr.filename and "/tests/" not in fr.filename:
            return f"{fr.filename.rsplit('/jaxstream/', 1)[1]}:{fr.lineno}"
    return "elsewhere"


def _arrays(tree: Any) -> int:
    return sum(isinstance(a, jax.Array) for a in jax.tree.leaves(tree))


@contextlib.contextmanager
def count_blocking() -> Iterator[Counter]:
    """Wraps the materialising entry points of device arrays while the block runs."""
    c = Counter()
    saved: dict = {}

    def wrap(name: str, fn: Any) -> Any:
        def run(self, *a, **k):
            c.enter(name)
            try:
                return fn(self, *a, **k)
            finally:
                c.leave()
        return run

    def wrap_tree(name: str, fn: Any) -> Any:
        def run(tree, *a, **k):
            c.enter(name, _arrays(tree))
            try:
                return fn(tree, *a, **k)
            finally:
                c.leave()
        return run

    def wrap_numpy(name: str, fn: Any) -> Any:
        def run(a, *args, **k):
            c.enter(name, int(isinstance(a, jax.Array)))
            try:
                return fn(a, *args, **k)
            finally:
                c.leave()
        return run

    value = ArrayImpl.__dict__["_value"]
    for name in METHODS:
        saved[name] = ArrayImpl.__dict__[name]
        setattr(ArrayImpl, name, wrap(name, saved[name]))
    ArrayImpl._value = property(wrap("_value", value.fget))
    get, ready = jax.device_get, jax.block_until_ready
    jax.device_get = wrap_tree("device_get", get)
    jax.block_until_ready = wrap_tree("block_until_ready", ready)
    numpys = {name: getattr(np, name) for name in NUMPY}
    for name, fn in numpys.items():
        setattr(np, name, wrap_numpy(f"np.{name}", fn))
    try:
        yield c
    finally:
        for name, fn in numpys.items():
            setattr(np, name, fn)
        for name, fn in saved.items():
            setattr(ArrayImpl, name, fn)
        ArrayImpl._value = value
        jax.device_get, jax.block_until_ready = get, ready


class Dispatch:
    """Traces (``jaxpr_trace`` events: a jit cache miss or a first eager op) and eager
    primitives (an op run outside ``jit``, one dispatch each) while a block runs, any thread;
    ``eager`` by primitive name."""

    def __init__(self) -> None:
        self.traces = 0
        self.eager: collections.Counter = collections.Counter()


@contextlib.contextmanager
def count_dispatch() -> Iterator[Dispatch]:
    """Counts what a block traces and the eager ops it runs (see :class:`Dispatch`)."""
    from jax._src import dispatch, monitoring

    d = Dispatch()
    lock = threading.Lock()

    def traced(name: str, _secs: float, **_kw: Any) -> None:
        if name == dispatch.JAXPR_TRACE_EVENT:
            with lock:
                d.traces += 1

    callable_ = dispatch.xla_primitive_callable

    def eager(prim: Any, **params: Any) -> Any:
        with lock:
            d.eager[prim.name] += 1
        return callable_(prim, **params)

    monitoring.register_event_duration_secs_listener(traced)
    dispatch.xla_primitive_callable = eager
    try:
        yield d
    finally:
        dispatch.xla_primitive_callable = callable_
        monitoring.unregister_event_duration_listener(traced)


def count_steady_step(ex: Any, batch: dict, warm: int = 2) -> tuple[Counter, Dispatch]:
    """(blocking counter, dispatch counter) of the step after ``warm`` steps of executor
    ``ex`` on ``batch`` (the first compiles, the second applies the first lazy records)."""
    for t in range(warm):
        ex.step(batch, jax.random.key(t))
    with count_blocking() as blocking, count_dispatch() as dispatch:
        ex.step(batch, jax.random.key(warm))
    return blocking, dispatch
