"""A store's reads: a unit's parameters or optimizer state from its committed (or this step's
staged) slot, each chunk checked against the crc32c the manifest committed, and a reader told
when a writer may have overwritten what it read. A part of
:class:`~jaxstream.stream.store.LayerStore`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxstream.stream.errors import StoreError, StoreNotCommittedError, StoreStaleError
from jaxstream.stream.manifest import MANIFEST, decode
from jaxstream.stream.store_parts import ReadInto, TreeFuture, Verified, read_error
from jaxstream.stream.writer_lock import writer_of

Unit = str | int  # "embed", "head" or a layer index


class Reads:
    """The read path of a :class:`~jaxstream.stream.store.LayerStore`."""

    def read(self, unit: Unit, *, staged: bool = False) -> TreeFuture:
        """Reads the parameters of ``unit`` (a layer index, "embed" or "head").

        On a local ``file`` store the chunk files are read (and their crc32c checked) when
        ``result()`` is called, on the caller's thread; other kvstores start reading at once.

        Args:
          staged: read this step's staged (uncommitted) write if there is one.
        Returns:
          A :class:`TreeFuture` of a pytree of fp32 NumPy arrays.
        """
        return self._read("params", unit, staged)

    def read_opt(self, unit: Unit, *, staged: bool = False) -> TreeFuture:
        """Starts reading the optimizer state of ``unit`` (needs ``optimizer`` at open)."""
        return self._read("opt", unit, staged)

    def _read(self, kind: str, unit: Unit, staged: bool) -> TreeFuture:
        part, l = self._part(unit)
        slot = self._slot(part, l, staged)
        # the slot may still be being written (staged, or a commit landing): the reader must
        # see the writes
        self._wait_for_writes(part if l is None else f"blocks/{l}", staged)
        table = self._m["leaves"][kind][part]
        idx = (slot,) if l is None else (l, slot)
        if kind == "params":
            treedef = self._treedefs[part]
        else:
            if part not in self._opt_treedefs:
                raise StoreError("optimizer state needs the optimizer: LayerStore.open(..., optimizer=...)")
            treedef = self._opt_treedefs[part]
        where = part if l is None else f"layer {l}"
        names = [f"{self._where}: {kind} leaf {e['name']!r} of {where} (slot {slot})" for e in table]
        expect = self._expected(kind, part, l, staged) or [None] * len(names)
        futs = []
        for i, name in enumerate(names):
            try:
                futs.append(self._leaf_read(kind, part, i, idx, name, expect[i]))
            except Exception as err:
                raise read_error(err, name) from err
        used = [(part, l, slot)]
        if staged or self._wrote:  # a writer: a chunk not as committed may be another writer's
            post = lambda t: t if t is not None else self._check_other_writer()
        else:
            post = lambda t: self._check_fresh(used) or t
        return TreeFuture(treedef, futs, post, names, count=lambda n: self.io.read(kind, n))

    def _leaf_read(self, kind: str, part: str, i: int, idx: tuple, name: str,
                   expect: int | None) -> Any:
        """A pending read of one leaf's chunk at ``idx``: the direct file read where the store
        allows it, else TensorStore's; checked against ``expect`` (a crc32c) unless None."""
        direct = self._direct[(kind, part, i)]
        if direct:
            return direct.read(idx, name, expect)
        read = ReadInto(self._arrays[(kind, part, i)][idx])
        return read if expect is None else Verified(read, expect, name)

    def _expected(self, kind: str, part: str, l: int | None, staged: bool) -> list | None:
        """The crc32c per leaf that the slot about to be read must hold: what this handle
        staged there, or what the manifest committed (None: a store from before digests)."""
        key = part if l is None else f"blocks/{l}"
        if staged and key in self._staged:
            return self._staged_digests.get((kind, key))
        table = self._m.get("digests", {}).get(kind, {}).get(part)
        return table if l is None or table is None else table[l]

    def _check_other_writer(self) -> None:
        """Raises StoreStaleError naming the other writer when one committed since this
        (writing) handle's step: a chunk it then finds overwritten is that writer's, not a file
        swapped or rolled back (called when a read finds a chunk other than committed)."""
        try:
            res = self._root.read(MANIFEST).result()
            self.io.read("manifest", len(res.value))
            m = decode(res.value, self.manifest_file) if res.state == "value" else None
        except Exception:  # noqa: BLE001 - the read error itself is reported instead
            return
        if m is not None and int(m["generation"]) != int(self._m["generation"]):
            raise StoreStaleError(self._other_writer(m))

    def _other_writer(self, m: dict | None) -> str:
        """The message for a writer whose store another writer has moved on to ``m``."""
        who = "no manifest" if m is None else f"step {m['step']} ({writer_of(m)})"
        held = self._writer.holder() if self._writer is not None else None
        lock = f"; {held} holds its writer lock now" if held else ""
        return (f"another writer is active on the store at {self._where}: since this handle's step "
                f"{self.step} it has committed {who}{lock}. One writer per "
                "store: stop the other run (or this one), then --resume the run that should go "
                "on, or reopen the store")

    def _check_fresh(self, used: list[tuple[str, int | None, int]]) -> None:
        """Raises StoreStaleError when a slot read by this (reading) handle may have been
        overwritten: the writer reuses a slot in the second commit after it was left."""
        try:
            res = self._root.read(MANIFEST).result()
        except Exception as err:
            raise read_error(err, self.manifest_file) from err
        self.io.read("manifest", len(res.value))
        if res.state != "value":
            raise StoreStaleError(f"{self.manifest_file} disappeared while reading step {self.step}")
        if res.value == self._fresh:  # the manifest this handle already found current
            return
        m = decode(res.value, self.manifest_file)
        gen0, gen = int(self._m["generation"]), int(m["generation"])
        if gen == gen0:
            self._fresh = res.value
            return
        slot = lambda mm, part, l: mm["slots"][part] if l is None else mm["slots"]["blocks"][l]
        if gen == gen0 + 1 and all(slot(m, p, l) == s for p, l, s in used):
            return
        raise StoreStaleError(
            f"the store at {self._where} was opened at step {self.step}; a writer has since "
            f"committed step {m['step']} and may have overwritten the slots this read used: "
            "reopen the store to read the new step")

    def read_params(self) -> dict:
        """Reads the whole committed parameter pytree (for evaluation and tests)."""
        wrote, self._wrote = self._wrote, True  # one freshness check for the whole tree
        used = ([("embed", None, self._slot("embed", None, False)),
                 ("head", None, self._slot("head", None, False))]
                + [("blocks", l, self._slot("blocks", l, False)) for l in range(self.num_layers)])
        try:
            layers = [self.read(l) for l in range(self.num_layers)]
            embed, head = self.read("embed").result(), self.read("head").result()
            blocks = jax.tree.map(lambda *xs: np.stack(xs), *[f.result() for f in layers])
        except StoreNotCommittedError:
            if not wrote:  # a reader of an older step is told that first
                self._check_fresh(used)
            raise
        finally:
            self._wrote = wrote
        if not wrote:
            self._check_fresh(used)
        return {"embed": embed, "blocks": blocks, "head": head}
