"""Processes of one composed run that agree or stop: a start-up barrier with a stated timeout,
and a watch that ends a process blocked by a lost peer with one line.

Under ``jax.distributed`` the processes of a ``data × stage`` mesh meet in collectives inside
every pass. A peer that dies leaves the others blocked in one; JAX's coordination service
would end them only at its heartbeat timeout (``heartbeat_timeout_seconds``, 100 s by
default), with an abort and a C++ stack dump. A peer that died resets its connections, so
the collective fails at once: :func:`lost_peer` then ends the process with one line and exit
status 2 (before ``jax.distributed``'s shutdown can wait for the dead peer). A peer that
stalls without dying is caught by :class:`PeerWatch`: when a step has made no progress (no
unit of any sweep finished) for ``timeout_s`` seconds, it writes one line to stderr and exits
with status 2. The store keeps
its last commit (a step commits atomically, after its collectives), so every process resumes
from the last step all copies committed.

The composed engine watches every step after its first (the first compiles its passes, which
can take longer than any unit later). Keep ``timeout_s`` above the slowest unit's time and below
the coordination service's heartbeat timeout.

Example::

    jax.distributed.initialize(..., heartbeat_timeout_seconds=300)
    ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(2, 4),
                          peer_timeout_s=120, startup_timeout_s=600)
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

EXIT_LOST_PEER = 2


def wait_for_peers(name: str, timeout_s: float, what: str = "startup_timeout_s") -> None:
    """Waits until every process of the run reaches the barrier ``name`` (the coordination
    service's, not a collective: a late peer is waited for up to ``timeout_s``).

    Raises:
      RuntimeError: one line, naming the timeout, when a peer did not arrive in time.
    """
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    try:
        client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as e:  # the service's error names the barrier and the missing tasks
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"process {jax.process_index()} of {jax.process_count()}: not every process reached "
            f"{name!r} within {what}={timeout_s:g} s ({first}); start every process "
            f"of the run, or raise {what}") from None


#: How long a process waits for its peers to compile a program before the first run of it
#: (the composed executor sets it from ``startup_timeout_s``).
compile_timeout_s: float = 300.0
_COMPILES = itertools.count()


class Together:
    """A jitted program that, on a mesh over several processes, is compiled ahead of its first
    run for each argument signature, then waits at a coordination-service barrier until every
    process has compiled it too (up to :data:`compile_timeout_s`), then runs.

    Without it a process that compiles slower than its peers (another machine, a cold cache)
    leaves them waiting inside the program's first collective, and Gloo fails a collective
    after a fixed 30 s (``DEADLINE_EXCEEDED``). Every process compiles the same programs in the
    same order (one SPMD program), so the barriers' names agree. In one process it only runs
    the program.
    """

    def __init__(self, jitted: Callable):
        self.jitted = jitted
        self._compiled: dict[Any, Callable] = {}

    def __call__(self, *args: Any) -> Any:
        from jax._src import distributed

        if distributed.global_state.client is None:
            return self.jitted(*args)
        leaves, tree = jax.tree.flatten(args)
        sig = (tree, tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))),
                            getattr(x, "sharding", None)) for x in leaves))
        run = self._compiled.get(sig)
        if run is None:
            run = compile_program(self.jitted, args)
            wait_for_peers(f"jaxstream-compiled-{next(_COMPILES)}", compile_timeout_s,
                           what="compile_timeout_s")
            self._compiled[sig] = run
        return run(*args)


def compile_program(jitted: Callable, args: tuple) -> Callable:
    """Lowers and compiles ``jitted`` for ``args`` (no collective runs)."""
    return jitted.lower(*args).compile()


def lost_peer(error: BaseException) -> None:
    """Ends this process with one line and exit status 2 after a collective failed (a peer
    that died resets the connection: Gloo raises at once). Exiting here skips
    ``jax.distributed``'s shutdown, which would wait for the lost peer until the heartbeat
    timeout and then abort with a stack dump. The store has dropped the failed step."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    sys.stderr.write(
        f"jaxstream: process {jax.process_index()} of {jax.process_count()}: a collective of "
        f"the composed step failed ({first[:200]}): a peer process is lost; the store keeps "
        f"its last commit; restart every process to resume\n")
    sys.stderr.flush()
    os._exit(EXIT_LOST_PEER)


class PeerWatch:
    """Ends this process (exit status 2, one line on stderr) when a step makes no progress for
    ``timeout_s`` seconds. :meth:`begin` / :meth:`end` bracket a step; :meth:`beat` marks
    progress."""

    def __init__(self, timeout_s: float, what: str = "composed step"):
        if not timeout_s > 0:
            raise ValueError(f"peer_timeout_s: must be > 0 seconds, got {timeout_s}")
        self.timeout_s, self.what = float(timeout_s), what
        self._last: float | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="jaxstream-peer-watch",
                                        daemon=True)
        self._thread.start()

    def begin(self) -> None:
        with self._lock:
            self._last = time.monotonic()

    def beat(self) -> None:
        with self._lock:
            if self._last is not None:
                self._last = time.monotonic()

    def end(self) -> None:
        with self._lock:
            self._last = None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            with self._lock:
                idle = None if self._last is None else time.monotonic() - self._last
            if idle is not None and idle > self.timeout_s:
                sys.stderr.write(
                    f"jaxstream: process {jax.process_index()} of {jax.process_count()}: the "
                    f"{self.what} made no progress for {idle:.0f} s (peer_timeout_s="
                    f"{self.timeout_s:g}): a peer process is lost or stalled; the store keeps "
                    f"its last commit; restart every process to resume\n")
                sys.stderr.flush()
                os._exit(EXIT_LOST_PEER)
