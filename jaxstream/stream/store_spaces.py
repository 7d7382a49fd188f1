"""The store's spaces beside its committed state: ``scratch`` (values within one step) and
``carry`` (values a pending update needs after the step, two slots named by committed
records). A part of :class:`~jaxstream.stream.store.LayerStore`."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import tensorstore as ts

from jaxstream.stream.errors import (
    StoreCorruptError,
    StoreError,
)
from jaxstream.stream.layout import open_array, write_group
from jaxstream.stream.store_parts import (
    ReadInto,
    TreeFuture,
    Verified,
    WriteFuture,
    digest,
    read_error,
)

Unit = str | int  # "embed", "head" or a layer index


class Spaces:
    """Scratch and carry of a :class:`~jaxstream.stream.store.LayerStore`."""

    # ------------------------------------------------------------------ scratch
    def _scratch_array(self, part: str, i: int) -> ts.TensorStore:
        key = ("scratch", part, i)
        if key not in self._arrays:
            self._arrays[key] = self._new_space_array(
                "scratch", part, i, 0, "scratch (within a step; not committed)")
        return self._arrays[key]

    def _new_space_array(self, space: str, part: str, i: int, slots: int,
                         kind: str) -> ts.TensorStore:
        """Creates the array of params leaf ``i`` of ``part`` in a space beside the committed
        state (``scratch``, ``carry``): the leaf's shape behind the layer axis (blocks) and
        ``slots`` slots (0: none), one chunk per layer and slot; the space's zarr group nodes
        are written with its first array."""
        e = self._m["leaves"]["params"][part][i]
        lead = ((self.num_layers,) if part == "blocks" else ()) + ((slots,) if slots else ())
        if not any(k[0] == space for k in self._arrays if isinstance(k, tuple)):
            write_group(self._root, space, {"jaxstream": {"kind": kind}})
            for p in ("embed", "blocks", "head"):
                write_group(self._root, f"{space}/{p}", {"jaxstream": {"part": p}})
        return open_array(
            self._root, f"{space}/{part}/{i}", self._ctx, create=True,
            shape=lead + tuple(e["shape"]), chunk=(1,) * len(lead) + tuple(e["shape"]),
            dtype=e["dtype"], attributes={"jaxstream": {"kind": space, "part": part,
                                                        "leaf": e["name"]}})

    def write_scratch(self, unit: Unit, tree: Any) -> list:
        """Writes a params-shaped pytree (e.g. an exact gradient) to the unit's scratch space.

        Scratch is not part of the committed state: it holds values that live within one step
        (a crash simply redoes the step). Scratch writes count with the staged writes against
        ``max_write_bytes``: past it, this waits for the oldest (host memory stays bounded
        however slow the disk). Returns the write futures.
        """
        part, l = self._part(unit)
        idx = () if l is None else (l,)
        self._begin_write()
        what = f"scratch of {part if l is None else f'layer {l}'} to the store at {self._where}"
        futs = []
        for i, x in enumerate(jax.tree_util.tree_leaves(tree)):
            x = np.asarray(x, np.float32)
            try:
                fut = WriteFuture(self._scratch_array(part, i)[idx].write(x), what)
            except Exception as err:
                raise self._write_error(what, err) from err
            with self._lock:  # counted with the staged writes: bounded by max_write_bytes
                self._writes.append((f"scratch/{part}/{l}", fut, x.nbytes))
            self.io.wrote("scratch", x.nbytes)
            futs.append(fut)
        self._throttle()
        return futs

    def read_scratch(self, unit: Unit) -> TreeFuture:
        """Reads what :meth:`write_scratch` wrote for ``unit`` this step."""
        part, l = self._part(unit)
        idx = () if l is None else (l,)
        n = len(self._m["leaves"]["params"][part])
        names = [f"{self._where}: scratch leaf {i} of {part if l is None else f'layer {l}'}"
                 for i in range(n)]
        try:
            futs = [self._scratch_array(part, i)[idx].read() for i in range(n)]
        except Exception as err:
            raise read_error(err, names[0]) from err
        return TreeFuture(self._treedefs[part], futs, None, names,
                          count=lambda n: self.io.read("scratch", n))

    # ------------------------------------------------------------------ carry
    def _carry_array(self, part: str, i: int, create: bool = False) -> ts.TensorStore:
        """The carry array of a leaf: opened as it is (it holds committed records' values),
        created only by the first write to a store that has none."""
        key = ("carry", part, i)
        if key not in self._arrays:
            try:
                self._arrays[key] = open_array(self._root, f"carry/{part}/{i}", self._ctx)
                return self._arrays[key]
            except Exception as err:  # noqa: BLE001 - absent: created below, or named on read
                if not create:
                    raise StoreCorruptError(f"{self._where}: carry array {part}/{i} is missing "
                                            f"or unreadable ({err}); a pending update needs it")
            self._arrays[key] = self._new_space_array(
                "carry", part, i, 2, "carry (values a pending update needs; two slots, named "
                                     "by the committed records that use them)")
        return self._arrays[key]

    def write_carry(self, unit: Unit, tree: Any, slot: int) -> tuple[list, list[int]]:
        """Writes a params-shaped pytree that a pending update needs after this step (e.g. a
        layer's exact mean gradient) into carry slot ``slot`` (0 or 1) of ``unit``.

        The caller commits, with the step, a record naming the slot and the crc32c of each
        leaf (returned); it writes the slot its unit's committed record does not name, so a
        step that fails or is killed leaves the committed records' values intact (shadow
        paging, as for the parameters). Counted against ``max_write_bytes``.

        Returns:
          ``(write futures, crc32c per leaf)``.
        """
        if slot not in (0, 1):
            raise StoreError(f"carry slot must be 0 or 1, got {slot!r}")
        part, l = self._part(unit)
        idx = (slot,) if l is None else (l, slot)
        self.check_sane()
        self._begin_write()
        what = f"carry of {part if l is None else f'layer {l}'} to the store at {self._where}"
        futs, crcs = [], []
        for i, x in enumerate(jax.tree_util.tree_leaves(tree)):
            x = np.asarray(x, np.float32)
            crcs.append(digest(x))
            try:
                fut = WriteFuture(self._carry_array(part, i, create=True)[idx].write(x), what)
            except Exception as err:
                raise self._write_error(what, err) from err
            with self._lock:
                self._writes.append((f"carry/{part}/{l}", fut, x.nbytes))
            self.io.wrote("carry", x.nbytes)
            futs.append(fut)
        self._throttle()
        return futs, crcs

    def read_carry(self, unit: Unit, slot: int, crcs: list[int]) -> TreeFuture:
        """Reads carry slot ``slot`` of ``unit``, checked against ``crcs`` (what
        :meth:`write_carry` returned): values that are not those raise by name."""
        part, l = self._part(unit)
        idx = (slot,) if l is None else (l, slot)
        n = len(self._m["leaves"]["params"][part])
        if len(crcs) != n:
            raise StoreError(f"carry record of {part if l is None else f'layer {l}'} names "
                             f"{len(crcs)} leaves, the store has {n}")
        self._wait_for_writes(f"carry/{part}/{l}")
        names = [f"{self._where}: carry leaf {i} of {part if l is None else f'layer {l}'} "
                 f"(slot {slot})" for i in range(n)]
        try:
            futs = [Verified(ReadInto(self._carry_array(part, i)[idx]), int(c), names[i])
                    for i, c in enumerate(crcs)]
        except Exception as err:
            raise read_error(err, names[0]) from err
        return TreeFuture(self._treedefs[part], futs, None, names,
                          count=lambda n: self.io.read("carry", n))
