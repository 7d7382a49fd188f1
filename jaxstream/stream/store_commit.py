"""A store's commit: the staged writes made the committed state at once (a manifest written
and fsynced, on the caller's thread, or landing on one of its own once the writes are durable:
then the caller goes on while they finish). A part of
:class:`~jaxstream.stream.store.LayerStore`."""

from __future__ import annotations

import json
import os
import socket
import threading

from jaxstream.stream.errors import StoreError, write_failed
from jaxstream.stream.guard import guard_commit
from jaxstream.stream.io_bytes import PART_OF_MANIFEST
from jaxstream.stream.manifest import encode
from jaxstream.stream.store_parts import (
    write_manifest,
)

Unit = str | int  # "embed", "head" or a layer index


class Commits:
    """Commit, landing and settling of a :class:`~jaxstream.stream.store.LayerStore`."""

    def commit(self, step: int, extra: dict | None = None, *, wait: bool = True) -> None:
        """Waits for the staged writes, then atomically makes them the committed state.

        Args:
          step: the step number to record.
          extra: JSON metadata committed together with the writes (replaces the old one).
          wait: False returns once the writes are done and the manifest is built: this handle
            reads the new step at once, while the manifest is written and fsynced on a thread
            (off the caller's critical path). The next write, commit, abort or :meth:`settle`
            waits for it first, so the next step's writes (to the slots this commit does not
            name) never overtake it; a kill before it lands resumes at the step before.
        Raises:
          StoreWriteError: a staged write or the manifest write failed; the store is left
            at its previous committed step.
        """
        self._begin_write()
        with self._lock:
            writes, self._writes = self._writes, []
            staged = dict(self._staged)
            digests = dict(self._staged_digests)
            norms, self._staged_norms = self._staged_norms, {}
            effective, self._effective = self._effective or {}, None
        if wait:
            for key, f, _ in writes:
                try:
                    f.result()
                except Exception as err:
                    raise self._write_error(key, err) from err
        m = json.loads(json.dumps(self._m))
        if "digests" in m:  # what rollback() needs to return to this commit, and check it
            m["previous"] = json.loads(json.dumps(
                {k: m[k] for k in ("step", "slots", "digests", "extra")}))
        for key, slot in staged.items():
            if key.startswith("blocks/"):
                m["slots"]["blocks"][int(key.split("/")[1])] = slot
            else:
                m["slots"][key] = slot
        if "digests" in m:
            for (kind, key), crcs in digests.items():
                if key.startswith("blocks/"):
                    m["digests"][kind]["blocks"][int(key.split("/")[1])] = crcs
                else:
                    m["digests"][kind][key] = crcs
        m["step"], m["generation"] = int(step), int(m["generation"]) + 1
        m["writer_pid"], m["writer_host"] = os.getpid(), socket.gethostname()
        if extra is not None:
            m["extra"] = extra
        guard_commit(self, m, {**effective, **{k: n for k, (c, n) in norms.items()
                                               if digests.get(("params", k)) == c}})
        try:
            self._count_manifest(m)
        except StoreError:
            self.abort()
            raise
        if not wait:
            return self._land(m, writes)
        try:
            write_manifest(self._root, m, self._where)
        except StoreError:
            self.abort()
            raise
        with self._lock:
            self._m = m
            self._staged.clear()
            self._staged_digests.clear()
        if self._writer is not None:
            self._writer.release()

    _effective: dict | None = None  # unit -> squared norm of params read, updated, not written

    def note_norm(self, unit: Unit, sq: float) -> None:
        """Gives the guard the squared norm ``sq`` (:func:`~jaxstream.stream.guard.tree_sq`) of
        ``unit``'s params as this step used them: its deferred updates applied on read but not
        written back (``rewrite_every``). The next commit judges it instead of the committed
        params' norm, so a diverging deferred update is seen at the first commit after it was
        applied, written back or not. Dropped by :meth:`abort`."""
        part, l = self._part(unit)
        with self._lock:
            self._effective = {**(self._effective or {}), part if l is None else f"blocks/{l}": sq}

    def _count_manifest(self, m: dict) -> None:
        """Counts the bytes of the manifest ``m`` a commit writes, and of the deferred
        updates' records inside it (refuses non-finite values, as its write would)."""
        self.io.wrote("manifest", len(encode(m)))
        pending = m.get("extra", {}).get(PART_OF_MANIFEST)
        if pending is not None:
            self.io.wrote(PART_OF_MANIFEST, len(json.dumps(pending, sort_keys=True).encode()))

    _landing: tuple | None = None  # (manifest before, thread, [error]) of a commit landing
    _landing_writes: list | tuple = ()  # (key, future, bytes): the writes of the commit landing
    _lost: BaseException | None = None  # a landing's error that an abort swallowed

    def _land(self, m: dict, writes: list) -> None:
        """Makes ``m`` this handle's state now and, on a thread, waits for the step's
        ``writes`` (durable: each chunk is fsynced) and then writes ``m`` (fsynced); the writer
        lock is released when it has landed. A read of a unit waits for its writes
        (:meth:`_wait_for_writes`)."""
        with self._lock:
            old, self._m = self._m, m
            self._staged.clear()
            self._staged_digests.clear()
            self._landing_writes = writes
        err: list = []

        def land() -> None:
            try:
                for key, f, _ in writes:
                    try:
                        f.result()
                    except Exception as e:
                        raise write_failed(key, self._where, e, old["step"]) from e
                write_manifest(self._root, m, self._where)
            except BaseException as e:  # noqa: BLE001 - raised by settle() on the caller's thread
                err.append(e)
            finally:
                if self._writer is not None:
                    self._writer.release()

        t = threading.Thread(target=land, name="jaxstream-commit", daemon=False)
        t.start()
        self._landing = (old, t, err)

    def settle(self) -> None:
        """Waits for a commit still landing (``commit(wait=False)``). Raises its error (the
        store is then back at the step before it, in memory as on disk)."""
        with self._begin_lock:
            self._settle_locked()

    def _settle_locked(self) -> None:
        landing, self._landing = self._landing, None
        lost, self._lost = self._lost, None
        if lost is not None:
            raise lost
        if landing is None:
            return
        old, t, err = landing
        t.join()
        with self._lock:
            self._landing_writes = ()
        if err:
            with self._lock:
                self._m = old
            raise err[0]
