"""The mission's machine as one engine: pipeline stages that stream their layers, replicas
beside them, over a ``data × stage`` mesh.

The streamed executor's sweeps (:mod:`jaxstream.stream.executor`) run unchanged; what changes
is where a block runs: its :class:`~jaxstream.stream.placement.Placement` is
:class:`StageChunks`. The step's layers are cut into *chunks* of M consecutive layers (M the
``stage`` size): chunk c puts layer cM + s on stage s. A sweep reads a chunk from the
:class:`~jaxstream.stream.LayerStore` (prefetching the next), places it one layer per stage,
and runs a GPipe pass of all N micro-batches through it (:mod:`.pipe`), each micro-batch's
examples split over ``data``; then the next chunk. So a device holds its stage's current layer
and the prefetched ones, never the model, and a replica reduces over ``data`` only what a
layer's estimate needs (its parameter gradient, inside the pass; the loss and the scalars d of
a forward estimate, in the head). The optimizer stays on the host and writes each updated
layer back through the store's crash-safe commit, as in the streamed executor.

Every estimator of the streamed executor runs; the gradient equals the in-memory estimator's
for the same key (the segment kernels are the same, applied per micro-batch). Activity
perturbation draws its activation tangents for the whole batch at once (each replica keeps its
rows of the draw) and runs its N micro-batches as one pass (no pipelining). The cost model is
in docs/composed.md.

Example::

    mesh = compose.make_mesh(data=2, stage=4)
    ex = compose.ComposedExecutor(stack, jg.hybrid(num_exact=2), optax.adam(1e-3), store, mesh=mesh)
    metrics = ex.step(batch, key)   # leaves (N, B, ...), B divisible by 2
"""

from __future__ import annotations

import itertools
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxstream.compose import peers
from jaxstream.compose.circular import Circular
from jaxstream.compose.peers import PeerWatch, lost_peer, settle_copies, wait_for_peers, watch_peers
from jaxstream.compose.pipe import DATA, STAGE
from jaxstream.compose.stage_passes import ACT, STASH
from jaxstream.compose.stage_passes import circular as _circular
from jaxstream.compose.stage_passes import compiled as _pass
from jaxstream.compose.stage_passes import stage_part as _stage_part
from jaxstream.grad.plan import Plan
from jaxstream.models.stack import Stack
from jaxstream.stream import kernels as K
from jaxstream.stream.errors import StoreError
from jaxstream.stream.executor import StreamConfig, StreamedExecutor, plan_of
from jaxstream.stream.placement import Placement, agree_across_processes
from jaxstream.stream.store import LayerStore
from jaxstream.stream.sweeps.common import copying
from jaxstream.stream.units import Unit, block
from jaxstream.stream.values import host_value

Schedule = Literal["circular", "chunked"]
SCHEDULES = typing.get_args(Schedule)


def check_updates_in_flight(n: int) -> None:
    """Refuses more than one unit's host update in flight, naming the field: checked on the
    stream engine only (``tests/stream/test_updates_in_flight.py``)."""
    if n != 1:
        raise ValueError(f"updates_in_flight: the composed engine keeps one unit's host "
                         f"update in flight (more is checked on the stream engine only); "
                         f"allowed: 1, got {n}")


class ComposedExecutor(StreamedExecutor):
    """Streamed training steps whose blocks run as pipelined chunks over a ``data × stage``
    mesh (see the module docstring): the streamed executor with a :class:`StageChunks`
    placement.

    Args:
      stack: the model; its depth must divide into ``mesh.shape["stage"]`` stages.
      estimator: any estimator of :class:`~jaxstream.stream.StreamedExecutor`.
      optimizer: an element-wise optax transformation (host, fp32, per layer).
      store: the :class:`~jaxstream.stream.LayerStore` holding the parameters.
      config: :class:`~jaxstream.stream.StreamConfig` (prefetch counts chunks).
      mesh: from :func:`make_mesh`.
      schedule: ``"circular"`` (default: each sweep is one circular pass over its chunks,
        :mod:`.circular`) or ``"chunked"`` (one GPipe pass per chunk, :mod:`.pipe`).
      peer_timeout_s: on a mesh over several processes, a peer that gives no sign of life for
        this long, or a step after the first (which compiles its passes) that makes no
        progress for this long, ends the process with one line and exit status 2 (a lost
        peer, :mod:`.peers`); keep it above the slowest unit's time and below half of
        ``jax.distributed``'s ``heartbeat_timeout_seconds`` (100 s by default).
      startup_timeout_s: on a mesh over several processes, how long opening the store waits
        for every process to arrive (start-up skew), and how long each program, compiled
        ahead of its first run, waits for every process to compile it (compile skew), before
        it refuses with one line.

    A step's metrics add ``ticks`` (the pipeline ticks its passes ran) and ``fill_ratio`` (the
    share of stage-ticks that computed).
    """

    engine = "composed"

    def __init__(self, stack: Stack, estimator: Any, optimizer: Any, store: LayerStore,
                 config: StreamConfig | None = None, *, mesh: Mesh, schedule: str = "circular",
                 peer_timeout_s: float = 40.0, startup_timeout_s: float = 300.0):
        if tuple(mesh.axis_names) != (DATA, STAGE):
            raise ValueError(f"mesh: axes must be {(DATA, STAGE)}, got {tuple(mesh.axis_names)} "
                             "(use jaxstream.compose.make_mesh)")
        m = mesh.shape[STAGE]
        if stack.num_layers % m:
            raise ValueError(f"mesh: stage = {m} must divide the model's {stack.num_layers} "
                             f"layers (allowed: divisors of {stack.num_layers})")
        config = config or StreamConfig()
        if schedule == "circular" and config.prefetch < 1:
            raise ValueError(f"prefetch: the circular schedule reads the next chunk while one "
                             f"computes, so prefetch must be >= 1, got {config.prefetch} (or "
                             f"use schedule='chunked')")
        check_updates_in_flight(config.updates_in_flight)
        placement = StageChunks(stack, plan_of(estimator, config.update, "composed").spec,
                                config.compute_dtype, mesh, schedule, peer_timeout_s,
                                startup_timeout_s)
        super().__init__(stack, estimator, optimizer, store, config, placement=placement)
        self.mesh, self.num_stages = mesh, m

    @property
    def ticks(self) -> int:
        """Pipeline ticks of the chunk passes since the last step began."""
        return self.placement.ticks

    @ticks.setter
    def ticks(self, value: int) -> None:
        self.placement.ticks = value


_OPENED = itertools.count()  # every process opens its executors in the same order


class StageChunks(Placement):
    """Block units are chunks of M consecutive layers, layer cM + s on stage s of a
    ``data × stage`` mesh; each kernel is a GPipe pass of the micro-batches (:mod:`.pipe`),
    examples split over ``data``."""

    def __init__(self, stack: Stack, spec: Any, dtype: Any, mesh: Mesh,
                 schedule: str = "circular", peer_timeout_s: float = 40.0,
                 startup_timeout_s: float = 300.0):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        for name, value in (("peer_timeout_s", peer_timeout_s),
                            ("startup_timeout_s", startup_timeout_s)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: a finite number of seconds > 0, got {value!r}")
        self.shared = len({d.process_index for d in mesh.devices.flat}) > 1
        self.startup_timeout_s, self._opened, self._stepped = float(startup_timeout_s), False, False
        self.watch = PeerWatch(peer_timeout_s) if self.shared else None
        if self.shared:  # compile skew: each program waits for every process's compile
            peers.compile_timeout_s = self.startup_timeout_s
            watch_peers(peer_timeout_s)  # a dead peer ends this process wherever it waits
        self.stack, self.spec, self.dtype, self.mesh = stack, spec, jnp.dtype(dtype), mesh
        self.num_stages, self.schedule = mesh.shape[STAGE], schedule
        self._stage = NamedSharding(mesh, P(STAGE))
        self._stash = NamedSharding(mesh, STASH)
        self._ticks, self._busy, self._counts = 0, 0, []

    def agree(self, store: Any) -> None:
        """Every process of a mesh that spans several streams from its own store copy: they
        must hold the same commit (:func:`~jaxstream.stream.placement.agree_across_processes`).
        On opening, a copy one step ahead of the others' rolls back to their commit first
        (:func:`~jaxstream.compose.peers.settle_copies`). A peer lost meanwhile (the check is a
        collective) ends the process with one line, as in a step."""
        if not self.shared:
            return
        refused = None
        try:
            if not self._opened:  # start-up skew: wait for every process, then compare
                wait_for_peers(f"jaxstream-open-{next(_OPENED)}", self.startup_timeout_s)
                self._opened = True
                refused = settle_copies(store)
            agree_across_processes(store)
        except jax.errors.JaxRuntimeError as err:  # after a commit: the peer did not get there
            lost_peer(err)
        except StoreError as err:
            if refused is None:
                raise
            raise StoreError(f"{err}; this copy was not rolled back: {refused}") from None

    def begin_step(self) -> None:
        self._ticks, self._busy, self._counts = 0, 0, []
        if self.watch is not None and self._stepped:  # the first step compiles: not watched
            self.watch.begin()

    def progress(self) -> None:
        if self.watch is not None:
            self.watch.beat()

    def end_step(self, error: BaseException | None = None) -> None:
        self._stepped = True
        if self.watch is not None:
            self.watch.end()
            if isinstance(error, jax.errors.JaxRuntimeError):  # a collective with a lost peer
                lost_peer(error)

    def _settle(self) -> None:
        """Adds the counts the circular windows reported (device values) to the totals."""
        if self._counts:  # every window's counts summed on the device, then read together
            busy, ran = host_value(K.total(self._counts))
            self._busy = self._busy + np.asarray(busy, np.int64)
            self._ticks += int(np.asarray(ran)[0])
        self._counts = []

    @property
    def ticks(self) -> int:
        """Pipeline ticks the passes ran since the step began (each window counts its own)."""
        self._settle()
        return self._ticks

    @ticks.setter
    def ticks(self, value: int) -> None:
        self._settle()
        self._ticks = value

    def busy_per_stage(self) -> np.ndarray:
        """Ticks each stage computed since the step began, counted by the passes run."""
        self._settle()
        return np.broadcast_to(np.asarray(self._busy, np.int64), (self.num_stages,)).copy()

    def metrics(self) -> dict:
        """The step's pipeline ticks and the share of stage-ticks that computed."""
        ticks, busy = self.ticks, self.busy_per_stage()
        fill = float(busy.sum() / (ticks * self.num_stages)) if ticks else 0.0
        return {"ticks": ticks, "fill_ratio": fill}

    # ------------------------------------------------------------------ units and values
    def chunks(self, layers: Sequence[int]) -> list[Unit]:
        m = self.num_stages
        if len(layers) % m:
            raise ValueError(f"depth: a step's {len(layers)} layers must divide into the "
                             f"{m} stages (use a depth policy with multiples of {m})")
        return [block(*layers[i:i + m]) for i in range(0, len(layers), m)]

    def merge_micro_batches(self, plan: Plan) -> bool:
        # the micro-batches are what the pipeline overlaps; activity and LG-FG-W compute them as
        # one (activity draws its tangents for the whole batch; LG-FG-W's local losses are means
        # over it)
        return plan.local

    def cast_batch(self, batch: dict) -> dict:
        b = jax.tree.leaves(batch)[0].shape[1]
        if b % self.mesh.shape[DATA]:
            raise ValueError(f"batch: the micro-batch size {b} must be divisible by "
                             f"data = {self.mesh.shape[DATA]}")
        return self._global(jax.tree.map(self._cast, batch), ACT)

    def split(self, unit: Unit, g: Any, hosts: list | None, fn: Callable) -> None:
        leaves = jax.tree.leaves(g)
        if all(isinstance(a, jax.Array) and a.is_fully_addressable for a in leaves):
            part = _stage_part  # one layer at a time from its device: no gathered chunk
        else:
            g, part = host_value(g), lambda a, i: a[i]  # across processes: gathered once
        for i, l in enumerate(unit.layers):
            fn(l, jax.tree.map(lambda a, i=i: part(a, i), g), None if hosts is None else hosts[i])

    def put(self, unit: Unit, hosts: list) -> Any:
        return self._put(hosts, self._stage)

    def _put(self, trees: list, sharding: NamedSharding) -> Any:
        """Stacks per-stage trees into arrays sharded by ``sharding`` (stage on the first
        axis): each device gets its own slice straight from its tree (no stacked host copy;
        only this process's devices, so it also runs under ``jax.distributed``)."""
        def put(*leaves):
            leaves = [self._cast(x) for x in leaves]
            return jax.make_array_from_callback(
                (len(leaves),) + leaves[0].shape, sharding,
                lambda i: leaves[i[0].start or 0][(None,) + tuple(i[1:])])
        return jax.tree.map(put, *trees)

    def _cast(self, a: Any) -> np.ndarray:
        a = np.asarray(a)
        return a.astype(self.dtype, copy=False) if np.issubdtype(a.dtype, np.floating) else a

    def _global(self, tree: Any, spec: P) -> Any:
        """Host values as arrays laid out by ``spec`` over the mesh (every process passes the
        same values)."""
        sh = NamedSharding(self.mesh, spec)
        return jax.tree.map(lambda a: jax.make_array_from_callback(
            np.shape(a), sh, lambda i, a=a: np.asarray(a)[i]), tree)

    def to_device(self, tree: Any) -> Any:
        return self._global(jax.tree.map(self._cast, tree), P())

    # ------------------------------------------------------------------ the passes
    def _go(self, name: str, kw: dict, dev, u: Unit, stage_aux, state, mb_aux, consts, slots,
            emitted: Callable | None = None):
        """Runs unit ``u`` of a sweep through the pass ``name``: ``(state, done)``.

        ``emitted(unit, emits)`` receives a unit's emits once they are complete and returns a
        ``(unit, gradient)`` to hand back, or None. Chunked: one GPipe pass now. Circular: one
        window of the sweep's circular pass; ``state`` is then the pass in flight
        (:class:`_Flight`) until :meth:`land`."""
        key = tuple(sorted(kw.items()))
        if self.schedule == "chunked":
            run = _pass(self.mesh, self.stack, self.spec, name, key)
            n = jax.tree.leaves(state)[0].shape[0]
            self._ticks += n + self.num_stages - 1
            self._busy = self._busy + n
            state, em = run(dev, state, mb_aux, stage_aux, consts, slots)
            out = emitted(u, em) if emitted else None
            return state, [out] if out is not None else []
        fl = state if isinstance(state, _Flight) else None
        if fl is None:
            n = jax.tree.leaves(state)[0].shape[0]
            circ = _circular(self.mesh, self.stack, self.spec, name, key, n)
            fl = _Flight(circ, circ.begin(dev, state, mb_aux, stage_aux, consts, slots))
        before = fl.carry
        prev = fl.prev or (u, dev, stage_aux)
        fl.carry, em, counts = fl.circ.window(prev[1], dev, fl.carry, mb_aux, prev[2],
                                              stage_aux, consts, slots, fl.prev is not None)
        self._counts.append(counts)
        out = emitted(fl.prev[0], em) if (emitted and fl.prev) else None
        fl.prev, fl.rest = (u, dev, stage_aux), (mb_aux, consts, slots, emitted)
        fl.before = before  # what the driver's prefetch fence waits for (not the main thread)
        return fl, [out] if out is not None else []

    def land(self, state) -> tuple[tuple, list]:
        if not isinstance(state, _Flight):
            return state, []
        fl, (mb_aux, consts, slots, emitted) = state, state.rest
        u, dev, aux = fl.prev
        carry, em, counts = fl.circ.tail(dev, fl.carry, mb_aux, aux, consts, slots)
        if counts is not None:
            self._counts.append(counts)
        out = emitted(u, em) if emitted else None
        return fl.circ.end(carry), [out] if out is not None else []

    @staticmethod
    def _slots(n: int, idx) -> tuple[jax.Array, int]:
        slots = np.full(n, -1, np.int32)
        if idx is not None:
            slots[np.asarray(idx)] = np.arange(len(idx), dtype=np.int32)
        return slots, (0 if idx is None else len(idx))

    def _layers(self, u: Unit) -> jax.Array:
        return self._put([np.int32(l) for l in u.layers], self._stage)

    def _unstash(self, stash: dict) -> Callable:
        """The emits of a stashing pass: one process keeps each unit's block inputs as device
        values with their copy to the host started (:meth:`prepare_reverse` reads them on the
        reverse sweep's loading thread); across processes they are gathered here, on the main
        thread, where every process runs its collectives in the same order."""
        def emitted(u: Unit, em: Any) -> None:
            if not self.shared:
                stash[u] = copying(em)
                return
            em = host_value(em)
            for i, l in enumerate(u.layers):
                stash[l] = em[i]
        return emitted

    def prepare_reverse(self, unit: Unit, stash: dict) -> None:
        if unit in stash:  # the inputs laid out for the vjp pass, off the main thread
            em = host_value(stash.pop(unit))
            stash[(unit, "put")] = self._put([em[i] for i in range(len(unit.layers))],
                                             self._stash)

    def jvp(self, dev, u, keys, state, stash: dict, stash_idx):
        slots, s = self._slots(self._n(state), stash_idx)
        state, _ = self._go("jvp", {"num_slots": s, "impl": _impl(keys)}, dev, u,
                            self._layers(u), state, _kd(keys), (), slots,
                            self._unstash(stash) if stash_idx is not None else None)
        return state

    def act(self, dev, u, keys, state):
        return self._go("act", {"impl": _impl(keys)}, dev, u, self._layers(u), state, _kd(keys),
                        (), self._slots(self._n(state), None)[0])[0]

    def act_grad(self, dev, u, keys, state, d):
        kw = {"num_examples": int(d.shape[0] * d.shape[2]), "emit_sum": True,
              "impl": _impl(keys)}
        return self._go("act_grad", kw, dev, u, self._layers(u), state, (_kd(keys), d), (),
                        self._slots(d.shape[0], None)[0], _handed)

    def local_grad(self, dev, u, keys, state, head_dev, x, weights: bool):
        n = jax.tree.leaves(x)[0].shape[0]
        kw = {"num_micro": int(n), "emit_sum": True, "weights": weights, "impl": _impl(keys)}
        return self._go("local", kw, dev, u, self._layers(u), state, (_kd(keys), x), head_dev,
                        self._slots(n, None)[0], _handed)

    runs_local_guess = True

    def local_exact(self, dev, u, state, head_dev, x):
        n = jax.tree.leaves(x)[0].shape[0]
        return self._go("local_exact", {"num_micro": int(n), "emit_sum": True}, dev, u,
                        self._layers(u), state, x, head_dev, self._slots(n, None)[0], _handed)

    def vjp(self, dev, u, stash: dict, state, each: bool):
        s = self._n(state)
        st = stash.pop((u, "put"), None)
        if st is None:
            st = self._put([stash[l] for l in u.layers], self._stash)
        if each:
            kw, slots = {"num_slots": s, "reverse": True}, np.arange(s, dtype=np.int32)
        else:
            kw, slots = {"emit_sum": True, "reverse": True}, np.zeros(s, np.int32)
        return self._go("vjp", kw, dev, u, st, state, np.arange(s, dtype=np.int32), (), slots,
                        _handed)

    def along(self, dev, u, v, state):
        n = self._n(state)
        return self._go("along", {}, dev, u, v, state, np.zeros(n, np.float32), (),
                        self._slots(n, None)[0])[0]

    def apply(self, dev, u, state, stash: dict):
        n = self._n(state)
        return self._go("apply", {"num_slots": n}, dev, u, self._layers(u), state,
                        np.zeros(n, np.float32), (), np.arange(n, dtype=np.int32),
                        self._unstash(stash))[0]

    @staticmethod
    def _n(state) -> int:
        return state.circ.n if isinstance(state, _Flight) else jax.tree.leaves(state)[0].shape[0]


class _Flight:
    """A circular pass in flight between a sweep's units: its programs, the pipeline state on
    the devices, the unit whose window ran last (with its device values) and the sweep's
    per-chain inputs."""

    def __init__(self, circ: Circular, carry: Any):
        self.circ, self.carry, self.prev, self.rest = circ, carry, None, None
        self.before: Any = None  # the carry before the last window


# a pass in flight is, to jax.block_until_ready and Array.is_ready, the carry its last window
# started from: the prefetch fence waits for it before loading the next unit, so one window
# is queued behind another while the main thread never waits for the device
jax.tree_util.register_pytree_node(
    _Flight, lambda fl: ((fl.before,), fl), lambda fl, _children: fl)


def _handed(u: Unit, em: Any) -> tuple:
    """A unit's gradient, handed back to the executor."""
    return u, em


_KD: list = [None, None]  # the last keys and their data: a sweep passes the same keys per unit


def _kd(keys: jax.Array) -> np.ndarray:
    """Key data of typed keys, as host values (the same on every process), read once per
    sweep."""
    if _KD[0] is not keys:
        _KD[:] = [keys, np.asarray(host_value(jax.random.key_data(keys)))]
    return _KD[1]


def _impl(keys: jax.Array) -> str:
    """The PRNG implementation of typed keys (their data crosses the pass raw)."""
    return str(jax.random.key_impl(keys))
