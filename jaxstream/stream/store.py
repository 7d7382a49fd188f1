"""LayerStore: a model's fp32 master parameters and optimizer state in TensorStore.

Layout (under one kvstore root, zarr3 on a local ``file`` kvstore by default)::

    manifest.json              committed state: step, model config, leaf specs, slot table
    params/{embed,head}/<leaf> shape (2, *leaf)      -- two slots
    params/blocks/<leaf>       shape (L, 2, *leaf)   -- one chunk per (layer, slot)
    opt/{embed,head,blocks}/<i> the same for each optimizer-state leaf

Crash safety (shadow paging): every unit (embed, head, each layer) has two slots. The
manifest names the committed slot of each unit. A step writes updated units only into
their *other* slot, waits until those writes are durable, then commits by replacing
``manifest.json`` in one atomic kvstore write (the ``file`` driver writes a temp file,
fsyncs it and renames it over the old one). A process killed at any moment leaves either
the old manifest, whose slots were never touched, or the new one, whose slots are all
written: the writes of a step become visible together, nothing half-written is read.

Integrity: every chunk carries a crc32c checksum and a missing chunk is an error, so a damaged
store raises :class:`StoreCorruptError` naming the leaf and layer instead of returning wrong
numbers or zeros; the manifest is checksummed and validated (:mod:`jaxstream.stream.manifest`).
Each commit also records in the manifest the crc32c of every chunk it committed (``digests``):
a sound chunk that holds other values than that — a file swapped between layers, copied in from
another store or slot, or rolled back to an older write — is refused by name on read.
Non-finite parameters or optimizer state are never staged (:class:`StoreNonFiniteError`).

One writer, consistent readers: a writer holds an OS lock (:class:`WriterLock`) from a step's
first write to its commit, and checks that no other process committed since it opened the
store. A handle that only reads checks after each read that the slots it read still belong to
its step (a writer overwrites a slot two commits later) and raises :class:`StoreStaleError`
otherwise: a reader sees the step it opened or an error, never a mix of steps.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
from typing import Any

import crc32c
import jax
import numpy as np
import tensorstore as ts

from jaxstream.stream.direct_read import FileChunks
from jaxstream.stream.errors import (
    StoreCorruptError,
    StoreDivergedError,
    StoreError,
    StoreNonFiniteError,
    StoreNotCommittedError,
    StoreNotFoundError,
    StoreStaleError,
    StoreWriteError,
)
from jaxstream.stream.guard import guard_commit, guard_message, leaf_sq, sane_after_rollback
from jaxstream.stream.io_bytes import PART_OF_MANIFEST, IOBytes
from jaxstream.stream.layout import KvSpec, make_context, open_array, open_kvstore, write_group
from jaxstream.stream.manifest import FORMAT, MANIFEST, PARTS, check_array, decode, encode
from jaxstream.stream.store_init import tree_structures, write_new_store
from jaxstream.stream.store_parts import (
    ReadInto,
    TreeFuture,
    Verified,
    WriteFuture,
    check_config,
    digest,
    read_error,
    write_manifest,
)
from jaxstream.stream.writer_lock import WriterLock, writer_of

__all__ = ["FORMAT", "LayerStore", "TreeFuture"]
Unit = str | int  # "embed", "head" or a layer index


class LayerStore:
    """Parameters and optimizer state of a model stack, read and written one layer at a time.

    Create with :meth:`create`, reopen with :meth:`open`. ``read(l)`` returns a future of
    layer ``l`` (a slice of ``params["blocks"]`` as NumPy fp32); ``write(l, p, opt)`` stages
    the updated layer; ``commit(step)`` makes every staged write of the step visible at once.

    Example::

        store = LayerStore.create("/nvme/run", params, optimizer=optax.adam(1e-3))
        layer = store.read(0).result()
        store.write(0, layer)
        store.commit(step=1)
    """

    def __init__(self, root: ts.KvStore, context: ts.Context, manifest: dict, where: str,
                 treedefs: dict, opt_treedefs: dict, writer: WriterLock | None = None):
        self._root, self._ctx, self._m, self._where = root, context, manifest, where
        self._treedefs, self._opt_treedefs = treedefs, opt_treedefs
        self.max_write_bytes = 256 << 20  # staged writes in flight before write() waits
        self._arrays: dict[tuple[str, str, int], ts.TensorStore] = {}
        self._direct: dict[tuple[str, str, int], FileChunks | None] = {}  # local-file fast path
        self._staged: dict[str, int] = {}
        self._staged_digests: dict[tuple[str, str], list[int]] = {}
        self._staged_norms: dict[str, tuple[list[int], float]] = {}  # unit -> (crcs, |p|^2)
        self._writes: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
        self._writer = writer
        self._wrote = False  # a handle that never wrote checks its reads are not stale
        self._begin_lock = threading.Lock()
        self.io = IOBytes()  # bytes read and written by kind (the executor resets it per step)
        file = self.manifest_file
        for kind in ("params", "opt"):
            for part in PARTS:
                lead = [self.num_layers, 2] if part == "blocks" else [2]
                for i, e in enumerate(self._m["leaves"][kind][part]):
                    try:
                        arr = open_array(root, f"{kind}/{part}/{i}", context)
                    except Exception as err:
                        raise read_error(err, f"{where}: array {kind}/{part}/{i} ({e['name']})") from err
                    check_array(file, f"leaves.{kind}.{part}[{i}]", arr, tuple(lead + e["shape"]),
                                e["dtype"])
                    self._arrays[(kind, part, i)] = arr
                    self._direct[(kind, part, i)] = FileChunks.of(arr, len(lead))
        self._fresh: bytes | None = None  # manifest last found current (_check_fresh)

    @property
    def manifest_file(self) -> str:
        return f"{self._where.rstrip('/')}/{MANIFEST}"

    # ------------------------------------------------------------------ creation / opening
    @classmethod
    def create(cls, location: KvSpec, params: dict, *, optimizer: Any = None,
               model_config: dict | None = None, step: int = 0, overwrite: bool = False,
               file_io_concurrency: int = 64, file_io_sync: bool = True) -> LayerStore:
        """Writes a new store from ``params`` = {"embed", "blocks" (leading layer axis), "head"}.

        Args:
          location: a path (local ``file`` kvstore), a kvstore URL or a kvstore JSON spec.
          params: the parameters; floating leaves are stored as fp32 masters. Leaves given as
            ``jax.ShapeDtypeStruct`` only allocate (zeros): a model larger than host memory
            is then initialised layer by layer with :meth:`write` and :meth:`commit`.
          optimizer: an optax transformation whose state is kept per unit (per layer).
          model_config: JSON-able description of the model, checked on :meth:`open`.
          overwrite: replace an existing committed store (otherwise it is an error).
        Returns:
          The open store at ``step``.
        """
        if not isinstance(params, dict) or set(params) != set(PARTS):
            raise StoreError(f"params must be a dict with keys {PARTS}, got "
                             f"{sorted(params) if isinstance(params, dict) else type(params)}")
        blocks = jax.tree_util.tree_leaves(params["blocks"])
        if not blocks:
            raise StoreError("params['blocks'] has no leaves")
        num_layers = int(np.shape(blocks[0])[0])
        for x in blocks:
            if np.ndim(x) < 1 or np.shape(x)[0] != num_layers:
                raise StoreError(f"every params['blocks'] leaf needs the leading layer axis {num_layers}, "
                                 f"got shape {np.shape(x)}")
        ctx = make_context(file_io_concurrency, file_io_sync)
        root = open_kvstore(location, ctx)
        lock = WriterLock(location)
        lock.acquire()  # nobody else writes while the store is (re)created
        try:
            exists = root.read(MANIFEST).result().state == "value"
        except Exception as err:
            raise read_error(err, f"{location}/{MANIFEST}") from err
        if exists and not overwrite:
            lock.release()
            raise StoreError(f"a store already exists at {location}; pass overwrite=True to replace it")
        try:
            write_new_store(root, ctx, location, params, optimizer, model_config, step, num_layers)
        except StoreError:
            raise
        except Exception as err:
            raise StoreWriteError(f"creating the store at {location} failed ({err}); no store was "
                                  "committed there") from err
        finally:
            lock.release()
        return cls.open(location, optimizer=optimizer, model_config=model_config, context=ctx)

    @classmethod
    def open(cls, location: KvSpec, *, template: dict | None = None, optimizer: Any = None,
             model_config: dict | None = None, file_io_concurrency: int = 64,
             file_io_sync: bool = True, context: ts.Context | None = None) -> LayerStore:
        """Opens the last committed step of an existing store.

        Args:
          location: as for :meth:`create`.
          template: params (or ``jax.eval_shape`` of them) giving the pytree structure; when
            omitted, nested dicts are rebuilt from the stored leaf names.
          optimizer: the optax transformation the store was created with (gives the state's
            structure); without it optimizer state cannot be read.
          model_config: when given, must equal the stored model config (else an error).
          context: a TensorStore context to share (e.g. for a ``memory://`` kvstore).
        Raises:
          StoreNotFoundError: no committed store at ``location``.
          StoreMismatchError: the store holds another model.
        """
        ctx = context or make_context(file_io_concurrency, file_io_sync)
        try:
            root = open_kvstore(location, ctx)
            res = root.read(MANIFEST).result()
        except Exception as e:
            raise StoreNotFoundError(f"no layer store at {location}: {e}") from e
        if res.state != "value":
            raise StoreNotFoundError(f"no layer store at {location}: {MANIFEST} is missing "
                                     "(never created, or creation did not finish)")
        m = decode(res.value, f"{str(location).rstrip('/')}/{MANIFEST}")
        if model_config is not None:
            check_config(m["model_config"], dict(model_config), str(location))
        treedefs, opt_treedefs = tree_structures(m, location, template, optimizer)
        return cls(root, ctx, m, str(location), treedefs, opt_treedefs, WriterLock(location))

    # ------------------------------------------------------------------ properties
    @property
    def step(self) -> int:
        """The last committed step."""
        return int(self._m["step"])

    @property
    def num_layers(self) -> int:
        return int(self._m["num_layers"])

    def unit_sizes(self) -> dict[str, int]:
        """Parameter count of the embed, of one block and of the head, from the manifest's
        leaf table (nothing read)."""
        return {part: sum(math.prod(e["shape"]) for e in self._m["leaves"]["params"][part])
                for part in PARTS}

    @property
    def model_config(self) -> dict:
        return dict(self._m["model_config"])

    @property
    def extra(self) -> dict:
        """JSON metadata committed with the last step (e.g. pending lazy updates)."""
        return json.loads(json.dumps(self._m.get("extra", {})))

    def fingerprint(self) -> int:
        """A 32-bit crc32c of what the committed step holds (step, slots and every chunk's
        digest): two copies of a store at the same commit have the same fingerprint."""
        body = {k: self._m.get(k) for k in ("step", "slots", "digests")}
        return int(crc32c.crc32c(json.dumps(body, sort_keys=True).encode()))

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's fp32 master parameters."""
        return int(sum(np.prod(e["shape"]) * np.dtype(e["dtype"]).itemsize
                       for e in self._m["leaves"]["params"]["blocks"]))

    @property
    def location(self) -> str:
        return self._where

    def _part(self, unit: Unit) -> tuple[str, int | None]:
        if isinstance(unit, str):
            if unit not in ("embed", "head"):
                raise StoreError(f"unit must be 'embed', 'head' or a layer index, got {unit!r}")
            return unit, None
        l = int(unit)
        if not 0 <= l < self.num_layers:
            raise StoreError(f"layer index must be in [0, {self.num_layers}), got {l}")
        return "blocks", l

    def _slot(self, part: str, l: int | None, staged: bool) -> int:
        key = part if l is None else f"blocks/{l}"
        if staged and key in self._staged:
            return self._staged[key]
        return int(self._m["slots"][part] if l is None else self._m["slots"]["blocks"][l])

    # ------------------------------------------------------------------ reads
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
        if staged:  # the staged slot may still be being written: its reader must see the writes
            self._wait_for_writes(part if l is None else f"blocks/{l}")
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
        self._check_sane()
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

    # ------------------------------------------------------------------ writes
    def write(self, unit: Unit, params: Any, opt_state: Any = None) -> None:
        """Stages new parameters (and optimizer state) of ``unit`` into its free slot.

        Nothing becomes visible until :meth:`commit`; the committed slot is never touched.
        """
        part, l = self._part(unit)
        key = part if l is None else f"blocks/{l}"
        self._check_sane()
        self._begin_write()
        with self._lock:
            slot = 1 - int(self._m["slots"][part] if l is None else self._m["slots"]["blocks"][l])
            self._staged[key] = slot
        idx = (slot,) if l is None else (l, slot)
        for kind, tree in (("params", params), ("opt", opt_state)):
            if tree is None:
                if kind == "opt" and self._m["leaves"]["opt"][part]:
                    # keep the optimizer state: copy it into the new slot as well
                    tree = self._read("opt", unit, staged=False).result()
                else:
                    continue
            leaves = jax.tree_util.tree_leaves(tree)
            table = self._m["leaves"][kind][part]
            crcs, sq = [], 0.0
            if len(leaves) != len(table):
                raise StoreError(f"{kind} of {key} has {len(leaves)} leaves, the store has {len(table)}")
            for i, (x, e) in enumerate(zip(leaves, table)):
                x = np.asarray(x, dtype=e["dtype"])
                if list(x.shape) != e["shape"]:
                    raise StoreError(f"{kind} leaf {e['name']!r} of {key}: shape {list(x.shape)}, "
                                     f"the store has {e['shape']}")
                if np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all():
                    self.abort()
                    raise StoreNonFiniteError(
                        f"{kind} leaf {e['name']!r} of {key} holds non-finite values; nothing of "
                        f"this step is committed, the store stays at step {self.step}")
                crcs.append(digest(x))
                if kind == "params" and np.issubdtype(x.dtype, np.inexact):
                    sq += leaf_sq(x)
                try:
                    fut = self._arrays[(kind, part, i)][idx].write(x)
                except Exception as err:
                    raise self._write_error(key, err) from err
                with self._lock:
                    self._writes.append((key, fut, x.nbytes))
                self.io.wrote(kind, x.nbytes)
            with self._lock:
                self._staged_digests[(kind, key)] = crcs
                if kind == "params":
                    self._staged_norms[key] = (crcs, sq)
            self._throttle()

    def _throttle(self) -> None:
        """Waits for the oldest staged writes while more than ``max_write_bytes`` are in
        flight, so host memory stays bounded (the writes stay invisible until commit)."""
        while True:
            with self._lock:
                inflight = sum(w[2] for w in self._writes)
                if inflight <= self.max_write_bytes or len(self._writes) <= 1:
                    return
                key, fut, _ = self._writes[0]
            try:
                fut.result()
            except Exception as err:
                raise self._write_error(key, err) from err
            with self._lock:
                if self._writes and self._writes[0][1] is fut:
                    self._writes.pop(0)

    def _wait_for_writes(self, key: str) -> None:
        """Waits for this step's in-flight writes of ``key`` (writes are asynchronous)."""
        with self._lock:
            futs = [f for k, f, _ in self._writes if k == key]
        for f in futs:
            try:
                f.result()
            except Exception as err:
                raise self._write_error(key, err) from err

    def _write_error(self, key: str, err: BaseException) -> StoreWriteError:
        self.abort()
        return StoreWriteError(f"writing {key} to the store at {self._where} failed ({err}); the store "
                               f"is unchanged at its last committed step {self.step}")

    def _begin_write(self) -> None:
        """Takes the writer lock for this step (once) and checks no other writer committed
        since this handle last saw the manifest; a commit still landing lands first."""
        self._wrote = True
        with self._begin_lock:  # prefetch threads stage writes concurrently
            self._settle_locked()
            if self._writer is None or self._writer.held:
                return
            self._acquire()

    def _acquire(self) -> None:
        self._writer.acquire()
        try:
            res = self._root.read(MANIFEST).result()
            self.io.read("manifest", len(res.value))
            m = decode(res.value, self.manifest_file) if res.state == "value" else None
        except Exception as err:
            self._writer.release()
            raise read_error(err, self.manifest_file) from err
        if m is None or int(m["generation"]) != int(self._m["generation"]):
            self._writer.release()
            raise StoreStaleError(self._other_writer(m))

    def abort(self) -> None:
        """Drops the staged writes of this step; the committed step stays as it was (a commit
        still landing lands first; its error, if any, is raised by the next :meth:`settle`)."""
        with self._begin_lock:
            try:
                self._settle_locked()
            except StoreError as err:
                self._lost = err
        with self._lock:
            self._staged.clear()
            self._staged_digests.clear()
            writes, self._writes = self._writes, []
        for _, f, _ in writes:
            try:
                f.result()
            except Exception:  # noqa: BLE001, S110 - already failing; nothing visible to undo
                pass
        if self._writer is not None:
            self._writer.release()

    def close(self) -> None:
        """Drops uncommitted writes and releases the writer lock."""
        self.abort()

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
        guard_commit(self, m, {k: n for k, (c, n) in norms.items()
                               if digests.get(("params", k)) == c})
        try:
            self._count_manifest(m)
        except StoreError:
            self.abort()
            raise
        if not wait:
            return self._land(m)
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

    def _count_manifest(self, m: dict) -> None:
        """Counts the bytes of the manifest ``m`` a commit writes, and of the deferred
        updates' records inside it (refuses non-finite values, as its write would)."""
        self.io.wrote("manifest", len(encode(m)))
        pending = m.get("extra", {}).get(PART_OF_MANIFEST)
        if pending is not None:
            self.io.wrote(PART_OF_MANIFEST, len(json.dumps(pending, sort_keys=True).encode()))

    _landing: tuple | None = None  # (manifest before, thread, [error]) of a commit landing
    _lost: BaseException | None = None  # a landing's error that an abort swallowed

    def _land(self, m: dict) -> None:
        """Makes ``m`` this handle's state now and writes it (fsynced) on a thread; the writer
        lock is released when it has landed."""
        with self._lock:
            old, self._m = self._m, m
            self._staged.clear()
            self._staged_digests.clear()
        err: list = []

        def land() -> None:
            try:
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
        if err:
            with self._lock:
                self._m = old
            raise err[0]

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
        """The step of the last commit that passed the guard (:mod:`jaxstream.stream.guard`):
        the store's own step unless its last commit failed it."""
        return int(self._m.get("sane", {}).get("step", self.step))

    def rollback_to_sane(self) -> int:
        """Makes the last sane commit current again (nothing to do when the last commit is
        sane) and returns its step; its chunks are checked as :meth:`rollback` checks them.

        Example::

            store = LayerStore.open("/nvme/run/stores/bp")
            store.rollback_to_sane()   # or: jaxstream run CONFIG --out RUN --rollback
        """
        target = self._m.get("sane", {})
        if "slots" not in target:
            return self.step
        return self._roll_back_to(target)

    def _check_sane(self) -> None:
        """Refuses to stage writes past a commit that failed the guard: they would overwrite
        the chunks of the last sane commit, the rollback target."""
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
            m["generation"], m["writer_pid"] = int(m["generation"]) + 1, os.getpid()
            write_manifest(self._root, m, self._where)
            self._m = m
        finally:
            if self._writer is not None:
                self._writer.release()
        return self.step

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
