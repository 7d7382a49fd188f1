"""A store's way back: the commit before the last one, or the last sane one, made current
again after every chunk of it is checked against its digests. A part of
:class:`~jaxstream.stream.store.LayerStore`."""

from __future__ import annotations

import json
import math
import os
import threading

from jaxstream.stream.errors import (
    StoreDivergedError,
    StoreError,
    StoreNotCommittedError,
)
from jaxstream.stream.guard import GROWTH, guard_message, sane_after_rollback, target_step
from jaxstream.stream.lazy import drop_fresh, unjudged
from jaxstream.stream.store_parts import (
    read_error,
    write_manifest,
)

Unit = str | int  # "embed", "head" or a layer index
_FAILING = threading.Lock()


class Rollbacks:
    """Rollback of a :class:`~jaxstream.stream.store.LayerStore`."""

    def rollback(self) -> int:
        """Makes the commit before the last one current again and returns its step.

        Every chunk of that commit that the last commit replaced is first checked against the
        commit's own digests: a step's writes go to the slots the commit before last used, so
        a step begun since (even one killed before its commit) may have overwritten them, and
        then the rollback is refused by name and the store stays as it was. One step back
        only: the store keeps two slots per unit.

        Example::

            store = LayerStore.open("/nvme/run/stores/hybrid")
            store.rollback()   # then train on with a new run: engine.continue_store=true
        """
        prev = self._m.get("previous")
        if prev is None:
            raise StoreError(f"{self.manifest_file}: no earlier commit to roll back to (the store "
                             f"was created, or rolled back, at step {self.step} and not "
                             "committed since)")
        return self._roll_back_to(prev)

    @property
    def sane_step(self) -> int:
        """The step :meth:`rollback_to_sane` returns to (:mod:`jaxstream.stream.guard`): the
        store's own step unless its last commit failed the guard."""
        target = self._m.get("sane", {})
        return target_step(target) if "slots" in target else int(target.get("step", self.step))

    def growth_bound(self) -> float:
        """The guard's bound on the parameters' global norm for the next commit: one unit's
        norm past it fails the commit whatever the others hold (inf: no sane norm known)."""
        sane = self._m.get("sane") or {}
        return GROWTH * max(1.0, float(sane["norm"])) if sane.get("norm") else math.inf

    def fail_commit(self, why: str, applied: list[Unit] | None = None) -> None:
        """Marks the last commit as failing the guard, for ``why`` (its deferred updates, applied
        on read, made parameters non-finite: the guard never saw them, as they were not yet
        applied when it judged the commit). Staged writes are dropped; writes past it are then
        refused and :meth:`rollback_to_sane` returns to the step before its updates."""
        with _FAILING:  # prefetch threads apply updates concurrently: the first one marks it
            if "slots" not in self._m.get("sane", {}):  # else already failed: the target stays
                self._fail(why, [self._key(u) for u in applied or []])

    def _key(self, unit: Unit) -> str:
        part, l = self._part(unit)
        return part if l is None else f"blocks/{l}"

    def _fail(self, why: str, applied: list[str]) -> None:
        self.abort()
        self._begin_write()
        try:
            m = json.loads(json.dumps(self._m))
            keep = {k: m[k] for k in ("slots", "digests", "extra") if k in m}
            norm = (m.get("sane") or {}).get("norm", 0.0)
            m["sane"] = {"step": int(m["step"]), "norm": norm, **keep, "norms": m.get("norms"),
                         "failed": {"step": int(m["step"]), "norm": None, "bound": None,
                                    "loss_finite": True, "why": why, "applied": applied}}
            self._publish(m)
        finally:
            if self._writer is not None:
                self._writer.release()

    def rollback_to_sane(self) -> int:
        """Makes the last sane commit current again (nothing to do when the last commit is
        sane) and returns its step; its chunks are checked as :meth:`rollback` checks them.

        With deferred (lazy) updates the commit after a diverging step still looks sane: the
        step's updates wait in it as records, applied on the next read, and the guard sees
        them at the next commit. So a sane commit that holds its own step's records goes back
        without them, to the step before, where an eager store goes back to (the same values).

        Example::

            store = LayerStore.open("/nvme/run/stores/bp")
            store.rollback_to_sane()   # or: jaxstream run CONFIG --out RUN --rollback
        """
        target = self._m.get("sane", {})
        if "slots" not in target:
            return self.step
        committed = (target.get("extra") or {}).get("pending") or {}
        older = unjudged(committed, target.get("failed", {}).get("applied", []))
        if older:
            raise StoreError(
                f"{self._where}: cannot roll back to a sane state: the commit of step "
                f"{target['failed']['step']} failed the guard on deferred updates that include "
                f"ones committed before step {target['step']}, kept waiting for "
                f"{', '.join(older)} (layers a depth policy skipped since) and never judged; any "
                "of them may be the diverging one, and the store keeps only the last two "
                "versions of a layer, so no state before them is whole. The store stays as it "
                "is: start from a copy of it, or a new store; with a depth policy that skips "
                "layers, train with eager updates to keep the way back")
        pending, since = drop_fresh(committed)
        if since is not None:  # its step's deferred updates are the diverging ones
            target = {**target, "step": since, "extra": {**target["extra"], "pending": pending}}
        return self._roll_back_to(target)

    def check_sane(self) -> None:
        """Raises :class:`StoreDivergedError` (why, and the way back) when the last commit
        failed the guard; a store that does so refuses to stage writes past it: they would
        overwrite the chunks of the last sane commit, the rollback target."""
        failed = self._m.get("sane", {}).get("failed")
        if failed is not None and "slots" in self._m["sane"]:
            raise StoreDivergedError(guard_message(self._where, self._m["sane"]))

    def _roll_back_to(self, prev: dict) -> int:
        """Makes the commit ``prev`` (step, slots, digests, extra) current after checking every
        chunk of it that the current commit replaced."""
        self._begin_write()
        try:
            for kind in ("params", "opt"):
                for part, l, slot in self._units(prev["slots"]):
                    now = self._m["slots"][part] if l is None else self._m["slots"]["blocks"][l]
                    if now != slot:
                        self._verify(kind, part, l, slot, prev["digests"][kind], prev["step"])
            m = json.loads(json.dumps(self._m))
            m.update({k: prev[k] for k in ("step", "slots", "digests", "extra")})
            m.pop("previous", None)
            for k, v in (("norms", prev.get("norms")), ("sane", sane_after_rollback(prev))):
                if v is None:
                    m.pop(k, None)
                else:
                    m[k] = v
            self._publish(m)
        finally:
            if self._writer is not None:
                self._writer.release()
        return self.step

    def _publish(self, m: dict) -> None:
        """Writes ``m`` (a metadata-only change: no new chunks) as the next generation and makes
        it this handle's state; the caller holds the writer lock."""
        m["generation"], m["writer_pid"] = int(m["generation"]) + 1, os.getpid()
        write_manifest(self._root, m, self._where)
        self._m = m

    def _units(self, slots: dict) -> list[tuple[str, int | None, int]]:
        return ([("embed", None, slots["embed"]), ("head", None, slots["head"])]
                + [("blocks", l, s) for l, s in enumerate(slots["blocks"])])

    def _verify(self, kind: str, part: str, l: int | None, slot: int, digests: dict,
                step: int) -> None:
        """Reads every leaf of a unit's ``slot`` and checks it against ``digests``."""
        expect = digests[part] if l is None else digests["blocks"][l]
        idx = (slot,) if l is None else (l, slot)
        where = part if l is None else f"layer {l}"
        for i, e in enumerate(self._m["leaves"][kind][part]):
            name = f"{self._where}: {kind} leaf {e['name']!r} of {where} (slot {slot})"
            try:
                self._leaf_read(kind, part, i, idx, name, expect[i]).result()
            except StoreNotCommittedError as err:
                raise StoreError(
                    f"cannot roll back to step {step}: {name} was overwritten by a later write "
                    f"(a step begun after it); the store stays at step {self.step}") from err
            except Exception as err:
                raise read_error(err, name) from err
