"""Processes of one composed run that agree or stop: a start-up barrier with a stated timeout,
watches that end a process whose peer is lost with one line, and copies that a restart brings
back to the step every process committed.

Under ``jax.distributed`` the processes of a ``data × stage`` mesh meet in collectives inside
every pass, and at coordination-service barriers (start-up, compiles, ``jax.distributed``'s
shutdown). A peer that dies ends the others in one of three ways, each bounded here:

* a collective with it fails at once (its connections reset): :func:`lost_peer` ends the
  process with one line and exit status 2 (before ``jax.distributed``'s shutdown can wait for
  the dead peer);
* every process writes a counter to the coordination service's key-value store about once a
  second (:class:`Liveness`); a peer whose counter has not moved for ``timeout_s`` seconds is
  lost, wherever this process waits (a barrier, the shutdown at exit, a first step that
  compiles): one line, exit status 2;
* a peer alive but stalled is caught by :class:`PeerWatch`: when a step has made no progress
  (no unit of any sweep finished) for ``timeout_s`` seconds, one line, exit status 2.

JAX's coordination service ends every survivor itself, with an abort and a C++ stack dump, once
the dead peer has missed its heartbeats: between half and all of ``heartbeat_timeout_seconds``
(100 s by default) after the death. So ``peer_timeout_s`` must stay below half of it (the
default 40 s does; raise both together). A lost process 0 takes the coordination service with
it: JAX then ends the others at once, with its own abort.

A process lost between the two copies' commits of a step leaves one copy a step ahead. On the
restart :func:`settle_copies` rolls that copy back to the commit the others hold (the store
keeps it, checked against its digests), naming what it did; copies that differ otherwise are
refused, naming each copy's step.

The composed engine watches every step after its first (the first compiles its passes, which
can take longer than any unit later). Keep ``timeout_s`` above the slowest unit's time.

Example::

    jax.distributed.initialize(..., heartbeat_timeout_seconds=300)
    ex = ComposedExecutor(stack, est, opt, store, cfg, mesh=make_mesh(2, 4),
                          peer_timeout_s=120, startup_timeout_s=600)
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import crc32c
import jax
import numpy as np

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
    except Exception as e:  # noqa: BLE001 - the service names the barrier and the missing tasks
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


def who() -> str:
    """``process I of N``, from ``jax.distributed``'s state (no backend call: a watch may fire
    while the interpreter exits and JAX's backends are already gone)."""
    from jax._src import distributed

    st = distributed.global_state
    return f"process {st.process_id} of {st.num_processes}"


def _stop(line: str) -> None:
    """Writes ``jaxstream: <who>: <line>`` to stderr and ends the process with status 2 (no
    clean-up: ``jax.distributed``'s shutdown would wait for the lost peer)."""
    try:
        sys.stderr.write(f"jaxstream: {who()}: {line}\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_LOST_PEER)


def lost_peer(error: BaseException) -> None:
    """Ends this process with one line and exit status 2 after a collective failed (a peer
    that died resets the connection: Gloo raises at once). Exiting here skips
    ``jax.distributed``'s shutdown, which would wait for the lost peer until the heartbeat
    timeout and then abort with a stack dump. The store has dropped the failed step, or holds
    the step it committed (a restart settles the copies, :func:`settle_copies`)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    _stop(f"a collective of the composed step failed ({first[:200]}): a peer process is lost; "
          "the store keeps its last commit; restart every process to resume")


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
                _stop(f"the {self.what} made no progress for {idle:.0f} s (peer_timeout_s="
                      f"{self.timeout_s:g}): a peer process is lost or stalled; the store keeps "
                      "its last commit; restart every process to resume")


class Liveness:
    """Signs of life between the processes of a run, through the coordination service's
    key-value store: every ``interval_s`` each process bumps its own counter and reads the
    others'. A peer heard from once whose counter then stays still for ``timeout_s`` seconds
    (dead, or its service gone) ends this process with one line and exit status 2, wherever it
    waits. Ends quietly once ``jax.distributed`` is shut down. One per process
    (:func:`watch_peers`)."""

    PREFIX = "jaxstream/alive/"

    def __init__(self, timeout_s: float, interval_s: float = 0.5):
        from jax._src import distributed

        st = distributed.global_state
        self.timeout_s, self.interval_s = float(timeout_s), float(interval_s)
        self.me, self.others = st.process_id, [p for p in range(st.num_processes)
                                               if p != st.process_id]
        self._heard: dict[int, tuple[str, float]] = {}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxstream-liveness",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self, wait_s: float = 10.0) -> None:
        """Stops the watch and waits (up to ``wait_s``) for a call to the service it is in.

        Registered to run at exit: a daemon thread still inside a call into the service when
        the interpreter finalises is ended by a forced unwind through C++ frames that catch it,
        and the process aborts (``FATAL: exception not rethrown``, exit status -6) after its
        work is done."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def _run(self) -> None:
        from jax._src import distributed

        for n in itertools.count():
            client = distributed.global_state.client
            if client is None or self._closed.is_set():  # shut down: the run is over
                return
            try:
                client.key_value_set(f"{self.PREFIX}{self.me}", str(n), allow_overwrite=True)
            except Exception:  # noqa: BLE001, S110 - the service is gone: no peer is heard
                pass
            now = time.monotonic()
            for p in self.others:
                try:
                    value = client.key_value_try_get(f"{self.PREFIX}{p}")
                except Exception:  # noqa: BLE001 - not written yet, or the service is gone
                    value = None
                last = self._heard.get(p)
                if value is not None and (last is None or last[0] != value):
                    self._heard[p] = (value, now)
                elif last is not None and now - last[1] > self.timeout_s:
                    if distributed.global_state.client is None or self._closed.is_set():
                        return  # shut down meanwhile
                    _stop(f"process {p} gave no sign of life for {now - last[1]:.0f} s "
                          f"(peer_timeout_s={self.timeout_s:g}): it is lost; the store keeps "
                          "its last commit; restart every process to resume")
            if self._closed.wait(self.interval_s):
                return


_LIVENESS: Liveness | None = None


def watch_peers(timeout_s: float) -> None:
    """Starts this process's :class:`Liveness` (once; a later call with a shorter timeout
    shortens it). Nothing when ``jax.distributed`` is not initialized."""
    global _LIVENESS
    from jax._src import distributed

    if distributed.global_state.client is None:
        return
    if _LIVENESS is None:
        _LIVENESS = Liveness(timeout_s)
    else:
        _LIVENESS.timeout_s = min(_LIVENESS.timeout_s, float(timeout_s))


def _gather(row: list[int]) -> np.ndarray:
    """Every process's ``row`` of 32-bit values, one row per process (a collective)."""
    from jax.experimental import multihost_utils

    mine = np.array(row, np.int64).astype(np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine.view(np.int32))).view(np.uint32)
    return every.reshape(jax.process_count(), len(row))


def _previous(store: Any) -> tuple[int, int]:
    """The step and fingerprint of the commit before the store's last (what
    :meth:`~jaxstream.stream.LayerStore.rollback` returns to), or ``(-1, 0)`` when it keeps
    none. Read from the manifest's record of it, as ``fingerprint`` reads the last commit."""
    prev = getattr(store, "_m", {}).get("previous")
    if not prev:
        return -1, 0
    body = {k: prev.get(k) for k in ("step", "slots", "digests")}
    return int(prev["step"]), int(crc32c.crc32c(json.dumps(body, sort_keys=True).encode()))


def ahead_by_one(every: np.ndarray) -> list[int] | None:
    """The processes whose copies :func:`settle_copies` rolls back, given every process's row
    ``(step, fingerprint, previous step, previous fingerprint)``: those at step s + 1 when the
    others are all at one commit of step s and every copy at s + 1 was committed on top of it.
    None when the copies agree or differ otherwise."""
    steps = every[:, 0]
    lo, hi = int(steps.min()), int(steps.max())
    if hi != lo + 1:
        return None
    behind, ahead = every[steps == lo], every[steps == hi]
    if len(set(behind[:, 1].tolist())) != 1:
        return None
    if not ((ahead[:, 2] == lo) & (ahead[:, 3] == behind[0, 1])).all():
        return None
    return [int(p) for p in np.flatnonzero(steps == hi)]


def settle_copies(store: Any) -> str | None:
    """On a restart, brings every process's store copy to the step all of them committed.

    A process lost between the two copies' commits of a step leaves its own copy or its peer's
    one step ahead. Every process gathers each copy's step and fingerprint and those of the
    commit before it; when the copies stand at steps s and s + 1 and every copy at s + 1 came
    from the commit the copies at s hold, the copies at s + 1 roll back to it (one line on
    stderr naming the copy and both steps). Anything else is left for
    :func:`~jaxstream.stream.placement.agree_across_processes` to refuse, naming each copy.
    Every process of the run must call it (it is a collective).

    Returns:
      why this copy's rollback was refused (the copies then disagree), or None.
    """
    from jaxstream.stream.errors import StoreError

    every = _gather([store.step, store.fingerprint(), *_previous(store)]).astype(np.int64)
    back = ahead_by_one(every)
    if back is None or jax.process_index() not in back:
        return None
    steps = every[:, 0]
    lo, hi = int(steps.min()), int(steps.max())
    late = ", ".join(str(p) for p in np.flatnonzero(steps == lo))
    try:
        store.rollback()
    except StoreError as err:
        return str(err)
    sys.stderr.write(
        f"jaxstream: {who()}: store copy {store.location} held step {hi}, which process(es) "
        f"{late} did not commit (a process was lost between the copies' commits): rolled "
        f"back to step {lo}, the step every copy holds\n")
    sys.stderr.flush()
    return None
