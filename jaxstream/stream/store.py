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
import threading
from typing import Any

import crc32c
import jax
import numpy as np
import tensorstore as ts

from jaxstream.stream.direct_read import FileChunks
from jaxstream.stream.errors import (
    StoreError,
    StoreNonFiniteError,
    StoreNotFoundError,
    StoreStaleError,
    StoreWriteError,
    write_failed,
)
from jaxstream.stream.guard import leaf_sq
from jaxstream.stream.io_bytes import IOBytes
from jaxstream.stream.layout import KvSpec, make_context, open_array, open_kvstore
from jaxstream.stream.manifest import FORMAT, MANIFEST, PARTS, check_array, decode
from jaxstream.stream.store_commit import Commits
from jaxstream.stream.store_init import check_optimizer, tree_structures, write_new_store
from jaxstream.stream.store_parts import (
    TreeFuture,
    check_config,
    digest,
    read_error,
)
from jaxstream.stream.store_reads import Reads
from jaxstream.stream.store_rollback import Rollbacks
from jaxstream.stream.store_spaces import Spaces
from jaxstream.stream.writer_lock import WriterLock

__all__ = ["FORMAT", "LayerStore", "TreeFuture"]
Unit = str | int  # "embed", "head" or a layer index


class LayerStore(Reads, Spaces, Commits, Rollbacks):
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
        # direct chunk writes fsync as TensorStore's would (its ``file_io_sync``)
        self._sync = bool((context.spec.to_json() if context.spec else {}).get("file_io_sync",
                                                                               True))

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
        check_optimizer(params, optimizer)  # before anything is written
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

    def check_model(self, template: Any, optimizer: Any = None) -> None:
        """StoreMismatchError unless the store holds parameters shaped as ``template`` (params,
        or ``jax.eval_shape`` of them) and, given ``optimizer``, its state: the checks
        :meth:`open` makes with a template and an optimizer."""
        tree_structures(self._m, self._where, template, optimizer)

    # ------------------------------------------------------------------ properties
    @property
    def step(self) -> int:
        """The last committed step."""
        return int(self._m["step"])

    @property
    def num_layers(self) -> int:
        return int(self._m["num_layers"])

    @property
    def generation(self) -> int:
        """The number of the last commit (every commit advances it, a rollback too)."""
        return int(self._m["generation"])

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

    # ------------------------------------------------------------------ writes
    def write(self, unit: Unit, params: Any, opt_state: Any = None) -> None:
        """Stages new parameters (and optimizer state) of ``unit`` into its free slot.

        Nothing becomes visible until :meth:`commit`; the committed slot is never touched.
        """
        part, l = self._part(unit)
        key = part if l is None else f"blocks/{l}"
        self.check_sane()
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
                if np.issubdtype(x.dtype, np.inexact):
                    x_sq = leaf_sq(x)  # a finite sum: every entry is finite (one pass, no mask)
                    if not math.isfinite(x_sq) and not np.isfinite(x).all():
                        self.abort()
                        raise StoreNonFiniteError(
                            f"{kind} leaf {e['name']!r} of {key} holds non-finite values; "
                            f"nothing of this step is committed, the store stays at step "
                            f"{self.step}")
                    sq += x_sq if kind == "params" else 0.0
                crcs.append(digest(x))
                direct = self._direct[(kind, part, i)]
                try:
                    fut = (direct.write(idx, x, crcs[-1], self._sync) if direct
                           else self._arrays[(kind, part, i)][idx].write(x))
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

    def _wait_for_writes(self, key: str, staged: bool = True) -> None:
        """Waits for the in-flight writes of ``key`` (writes are asynchronous): those of a
        commit still landing, which its reads see, and with ``staged`` this step's."""
        with self._lock:
            landing = [f for k, f, _ in self._landing_writes if k == key]
            futs = landing + ([f for k, f, _ in self._writes if k == key] if staged else [])
        for f in futs:
            try:
                f.result()
            except Exception as err:
                if f in landing:  # the landing's own error, raised here once (not kept for
                    self.settle()  # the next write to raise again)
                raise self._write_error(key, err) from err

    def _write_error(self, key: str, err: BaseException) -> StoreWriteError:
        self.abort()
        return write_failed(key, self._where, err, self.step)

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
        if not self._swept:  # what writers killed mid-write left (once: none is writing now)
            self._swept = True
            for chunks in {d for d in self._direct.values() if d}:
                chunks.remove_temporaries()

    _swept = False  # the killed writers' temporary chunk files removed (first write)

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
            self._effective = None
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
