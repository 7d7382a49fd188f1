"""The ``stream`` engine: ``engine: {type: stream, ...}`` trains with layers streamed from a store.

The store *is* the checkpoint of the parameters and optimizer state: every step commits to it
atomically, and its step is the truth for the streamed parameters. The runner's orbax
checkpoint holds only the step counter. On a resume (:meth:`StreamEngine.resume_at`) the
engine reopens the store and the run continues from the *store's* step, which may be ahead of
the last checkpoint (a run killed between checkpoints): those steps are not redone, and their
metrics come from the run's log (or are marked lost). A store behind the checkpoint, a missing
store, or an existing store in a new run is an error that says what to do.

Each arm has its own store (``{arm}`` in ``engine.store``; a store records the arm that owns
it); ``store: null`` keeps it in the run directory (``<run>/stores/<arm>``). Non-finite
parameters are never committed: a diverging step leaves the store at its last finite step and
reports a non-finite loss, which stops the run as diverged. A commit that fails the store's
divergence guard (:mod:`jaxstream.stream.guard`: parameter norm past 10x the last sane commit's,
or a non-finite loss) stops the run too (``guard_failed``); the store keeps the last sane
commit, and ``jaxstream run ... --rollback`` continues from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp

from jaxstream.experiment.engine_stream_checks import (
    check_copy,
    check_optimizer,
    check_owner,
    check_store_paths,
    damaged,
    data_bytes,
    identity,
    unreadable,
)
from jaxstream.experiment.engines import EngineConfig, register_engine, split_micro_batches
from jaxstream.experiment.rundir import read_run_id
from jaxstream.ranges import Count, Every
from jaxstream.stream.depth import DepthPolicy
from jaxstream.stream.errors import (
    StoreCorruptError,
    StoreDivergedError,
    StoreError,
    StoreMismatchError,
    StoreNonFiniteError,
    StoreNotFoundError,
    StoreReadError,
)
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from jaxstream.stream.store import LayerStore


@register_engine("stream")
@dataclasses.dataclass(frozen=True)
class StreamEngineConfig(EngineConfig):
    """Options of ``engine: {type: stream}``.

    Attributes:
      store: where the layer stores live (a path or a TensorStore kvstore URL); ``{arm}`` is
        replaced by the arm's name and is required when there are several arms. ``null``:
        ``<run directory>/stores/<arm>``, so the run can be resumed.
      continue_store: a new run may train on from an existing store at ``store`` (otherwise
        an existing store is refused; ``--resume`` always continues it).
      prefetch: layers read ahead of the computing one.
      compute_dtype: dtype on the device; the master copy and optimizer stay fp32.
      update: "eager" or "lazy": each layer's update applied when it is next read (the
        forward estimator's, and a hybrid's deferred combine: two reads per layer per step).
      rewrite_every: with ``update: lazy``, a forward estimator's layer is written back only
        when k updates wait for it (replayed from their keys when it is read meanwhile):
        one read and 1/k writes per layer per step (:class:`StreamConfig`).
      async_commit: each step's manifest is written and fsynced on a thread while the next
        step computes (off the step's critical path; a kill before it lands resumes at the
        step before, and the runner waits for it before each checkpoint, so a checkpoint is
        never ahead of its store). false: every step returns committed.
      layers_per_unit: G consecutive layers read and run on the device as one program (fewer
        dispatches and waits at small widths); the forward estimator with weight tangents and
        backprop only (:class:`~jaxstream.stream.placement.Grouped`).
      updates_in_flight: units' host updates queued beside the compute before the step
        waits for the oldest (1; 2 lets the dispatch run on while the host catches up:
        one unit's update more in host memory, the same values).
      residuals: "keep" (backprop's reverse sweep runs each block's pullback from residuals
        its forward sweep kept, no forward recompute) or "recompute" (inputs only: less
        device memory, a third more FLOPs per dense block).
      micro_batches: N for backprop/forward (a hybrid estimator brings its own N).
      depth: dynamic depth policy (kind: all | stochastic | progressive).
      file_io_concurrency: TensorStore's concurrent file operations.
    """

    store: str | None = None
    continue_store: bool = False
    prefetch: Every = 2
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    update: Literal["eager", "lazy"] = "eager"
    rewrite_every: Count = 1
    async_commit: bool = True
    layers_per_unit: Count = 1
    residuals: Literal["keep", "recompute"] = "keep"
    updates_in_flight: Count = 1
    micro_batches: Count = 1
    depth: DepthPolicy = dataclasses.field(default_factory=DepthPolicy)
    file_io_concurrency: Count = 64
    streams_layers: ClassVar[bool] = True  # the memory check counts one layer, not the model
    places_blocks: ClassVar[bool] = True  # a sequential model runs as a stack (to_stack)

    def check(self) -> None:
        if self.store is not None and not str(self.store).strip():
            raise ValueError("store: must be a path, a kvstore URL or null, got ''")
        if self.rewrite_every > 1 and self.update != "lazy":
            raise ValueError(f"rewrite_every: {self.rewrite_every} needs update: lazy (an eager "
                             f"update writes every layer it updates); allowed with "
                             f"update: {self.update}: 1")

    def units(self, depth: int) -> tuple[int, str]:
        """How many units a step reads (what ``prefetch`` counts) for ``depth`` blocks, and
        what they are."""
        g = self.layers_per_unit
        if g == 1:
            return depth + 2, f"embed, {depth} blocks, head"
        n = -(-depth // g)
        return n + 2, f"embed, {n} units of up to {g} blocks, head"

    def check_model(self, model: Any) -> None:
        """Read-ahead and queued updates within the model: at most its units after the
        computing one, at most its units' updates queued, and units of at most its blocks,
        when the model section says its depth."""
        depth = getattr(model, "depth", None)
        if not isinstance(depth, int):
            return
        if self.layers_per_unit > depth:  # as prefetch: nothing past the model
            raise ValueError(f"engine.layers_per_unit: {self.layers_per_unit} layers per unit, "
                             f"the model has {depth} blocks; allowed: 1..{depth}")
        n, what = self.units(depth)
        if self.prefetch > n - 1:
            raise ValueError(f"engine.prefetch: {self.prefetch} reads past the model's {n} "
                             f"units ({what}); allowed: 0..{n - 1}")
        if self.updates_in_flight > n:  # a unit's next read waits for its own update
            raise ValueError(f"engine.updates_in_flight: {self.updates_in_flight} host "
                             f"updates queued, a step has {n} units ({what}); "
                             f"allowed: 1..{n}")

    def with_store(self, path: str) -> StreamEngineConfig:
        """This section with its store at ``path`` (a sweep lane's scratch store)."""
        return dataclasses.replace(self, store=path, continue_store=False)

    def location(self, arm: str, run_dir: str | Path | None = None) -> str | None:
        """The store of ``arm`` (None for ``store: null`` without a run directory)."""
        if self.store is None:
            return None if run_dir is None else str(Path(run_dir) / "stores" / arm)
        return self.store.replace("{arm}", arm)

    def check_arms(self, names: list[str]) -> None:
        """Arms never share a store: several arms need ``{arm}`` in ``engine.store``."""
        if self.store is not None and len(names) > 1 and "{arm}" not in self.store:
            raise ValueError(f"engine.store: {self.store!r} would be shared by the arms "
                             f"{', '.join(names)}; put {{arm}} in the path (e.g. "
                             f"{self.store.rstrip('/')}/{{arm}}) or use null")

    def check_optimizer(self, optimizer: Any, field: str) -> None:
        """The host optimizer updates one layer at a time, as its gradient completes: a clip
        by the global norm of every layer's gradient cannot be applied (clipping each layer by
        its own norm would be another optimizer, silently)."""
        if optimizer.clip_norm is not None:
            raise ValueError(f"{field}.clip_norm: the {self.kind()} engine updates each layer "
                             "on the host as its gradient completes, so it cannot clip by the "
                             "global norm of all layers; allowed: null (or train in memory)")

    def kind(self) -> str:
        """The engine's ``type:`` name, for messages."""
        from jaxstream.experiment.config import registered_name

        return registered_name(self) or "streamed"

    def check_arm(self, arm: Any, field: str) -> None:
        """The streamed executor runs the arm's estimator with this ``update`` (checked when
        the config is loaded, before any arm trains)."""
        from jaxstream.stream.executor import plan_of
        from jaxstream.stream.placement import check_grouped

        try:
            plan = plan_of(arm.estimator.build(), self.update)
            check_grouped(plan, self.layers_per_unit, "stream")
        except (ValueError, TypeError) as err:
            raise ValueError(f"{field}.estimator: {err}") from None

    def check_run(self, names: list[str], resume: bool) -> None:
        """Before anything is written: a new run refuses an existing store (unless
        ``continue_store``), and a store path that is or lies under a file is refused; only
        local paths can be checked here (:func:`check_store_paths`)."""
        check_store_paths(self, names, resume)

    def build(self, *, stack: Any, estimator: Any, optimizer: Any, model: Any = None,
              arm: Any = None, micro_batches: int = 1, optimizer_config: Any = None,
              learning_rate: float | None = None, total_steps: int | None = None,
              **_: Any) -> StreamEngine:
        """The engine (the registry calls this; keywords: :mod:`jaxstream.experiment.engines`):
        its own section, the model and optimizer sections and the arm's name, not the whole
        experiment config."""
        return self.engine_class()(self, stack=stack, estimator=estimator, optimizer=optimizer,
                                   model=model, arm=arm, micro_batches=micro_batches,
                                   optimizer_config=optimizer_config,
                                   learning_rate=learning_rate, total_steps=total_steps)

    def engine_class(self) -> type[StreamEngine]:
        """The engine :meth:`build` makes (the composed engine's section makes its own)."""
        return StreamEngine


class StreamState(NamedTuple):
    """The engine state orbax saves: the step (parameters live in the store)."""

    step: jax.Array



class StreamEngine:
    """Engine protocol over a :class:`StreamedExecutor` (see module docstring).

    Example::

        eng = StreamEngine(StreamEngineConfig(store="/nvme/s"), stack=stack, estimator=est,
                           optimizer=optax.adam(1e-3))
        state = eng.init(params, key)            # the store is created on first use
        state, metrics = eng.step(state, batch, key)
    """

    def __init__(self, cfg: StreamEngineConfig, *, stack: Any, estimator: Any, optimizer: Any,
                 model: Any = None, arm: Any = "arm", micro_batches: int = 1,
                 optimizer_config: Any = None, learning_rate: float | None = None,
                 total_steps: int | None = None, **_: Any):
        """``model``: the model section (recorded in the store, checked when it is reopened);
        ``arm``: the arm's name (an arm section gives its ``name``), which owns the store;
        ``optimizer_config``: the optimizer section (its name and options are recorded in the
        store with every step, and a store holding another optimizer's state is refused)."""
        self.cfg, self.stack, self.estimator, self.optimizer = cfg, stack, estimator, optimizer
        self.micro_batches = micro_batches if micro_batches > 1 else cfg.micro_batches
        self.arm = arm if isinstance(arm, str) else getattr(arm, "name", "arm")
        self.location = cfg.location(self.arm)
        self.model_config = ({"type": type(model).__name__, **dataclasses.asdict(model)}
                             if dataclasses.is_dataclass(model) else {"name": stack.name})
        self.model_config["num_layers"] = stack.num_layers
        self.model_config["arm"] = self.arm  # a store belongs to one arm
        self.executor: StreamedExecutor | None = None
        self._init_params: Any = None
        self.run_id: str | None = None  # the run that owns the store (set by resume_at)
        self.run_dir: str | None = None  # its directory, resolved (set by resume_at)
        self._stamp: dict = {}  # committed with every step: the run, and a hand-over
        self.optimizer_id = (None if optimizer_config is None else
                             {"name": optimizer_config.name,
                              "options": dict(optimizer_config.options)})
        self.optimizer_config = optimizer_config
        # the rate the store's deferred (lazy) updates are made at: committed with every step
        self.rate = (None if learning_rate is None else
                     {"lr": float(learning_rate), "total_steps": total_steps})

    def _open(self) -> LayerStore | None:
        if self.location is None:
            raise StoreError("engine.store is null and no run directory was given: the runner "
                             "keeps the store in the run directory; give engine.store a path "
                             "when using StreamEngine directly")
        try:
            return LayerStore.open(self.location, optimizer=self.optimizer,
                                   model_config=self.model_config,
                                   file_io_concurrency=self.cfg.file_io_concurrency)
        except StoreNotFoundError:
            return None
        except (StoreCorruptError, StoreReadError) as err:
            raise unreadable(err) from err
        except StoreMismatchError:  # another optimizer's state: said so, naming both
            with contextlib.closing(LayerStore.open(self.location)) as plain:
                check_optimizer(plain, self.location, self.optimizer_id)
            raise

    def _executor(self) -> StreamedExecutor:
        if self.executor is None:
            store = self._open()
            if store is None:
                store = LayerStore.create(self.location, jax.device_get(self._init_params),
                                          optimizer=self.optimizer, model_config=self.model_config,
                                          file_io_concurrency=self.cfg.file_io_concurrency)
            self._init_params = None  # the store holds them now: not kept for the run
            self.executor = self._new_executor(store)
        return self.executor

    def _new_executor(self, store: LayerStore, optimizer: Any = None) -> StreamedExecutor:
        scfg = StreamConfig(self.cfg.prefetch, self.cfg.compute_dtype, self.cfg.update,
                            self.cfg.depth, rewrite_every=self.cfg.rewrite_every,
                            async_commit=self.cfg.async_commit,
                            layers_per_unit=self.cfg.layers_per_unit,
                            residuals=self.cfg.residuals,
                            updates_in_flight=self.cfg.updates_in_flight)
        return StreamedExecutor(self.stack, self.estimator, optimizer or self.optimizer, store,
                                scfg)

    def init(self, params: Any, key: jax.Array) -> StreamState:
        """Remembers ``params``: the store is created from them (or reopened) on first use."""
        del key
        self._init_params = params
        return StreamState(jnp.asarray(0, jnp.int32))

    def resume_at(self, state: StreamState, start: int, *, run_dir: str | Path,
                  resume: bool, rollback: bool = False) -> tuple[StreamState, int]:
        """Reconciles the restored checkpoint (``state``, step ``start``) with the store.

        Returns the state and step to continue from: the store's step when it is ahead of the
        checkpoint (those steps are not redone). Raises StoreError when the store is missing
        or behind the checkpoint, or exists in a new run without ``continue_store``. With
        ``rollback`` the store first goes back to its last sane commit
        (:meth:`LayerStore.rollback_to_sane`), and the run continues from there.
        """
        if self.cfg.store is None:
            self.location = self.cfg.location(self.arm, run_dir)
        self.run_id = read_run_id(run_dir)
        self.run_dir = str(Path(run_dir).resolve())
        self._stamp = self._identity()
        may_exist = resume or self.cfg.continue_store
        ckpt = int(state.step)
        store = self._open()
        if store is None:
            if ckpt > 0:
                raise StoreError(f"--resume: the checkpoint of arm {self.arm!r} is at step {ckpt} "
                                 f"but there is no layer store at {self.location}; restore the "
                                 "store or start a new run")
            self._executor()
            return state, start
        if rollback:
            self._check_owner(store, resume)
            store.rollback_to_sane()
            if store.step < ckpt:
                state, start, ckpt = StreamState(jnp.asarray(store.step, jnp.int32)), \
                    store.step, store.step
        if resume and store.step > ckpt:
            check_copy(store, self.location, self.run_id, self.run_dir, ckpt)
        if store.step < ckpt:
            raise StoreError(f"the layer store at {self.location} is at step {store.step}, behind "
                             f"the checkpoint at step {ckpt}: it is not this run's store (or an "
                             "older copy); point engine.store at this run's store or start a new run")
        if not may_exist:
            raise StoreError(f"engine.store: a layer store already exists at {self.location} "
                             f"(step {store.step}); pass --resume to continue that run (a train "
                             "run), set "
                             "engine.continue_store=true to train on from it, or choose "
                             "another path")
        self._check_owner(store, resume)
        check_optimizer(store, self.location, self.optimizer_id)
        store.check_sane()  # a diverged store is rolled back first, never trained past
        self._settle_pending(store)
        self.executor = self._new_executor(store)
        if store.step > ckpt:
            return StreamState(jnp.asarray(store.step, jnp.int32)), store.step
        return state, start

    def _check_owner(self, store: LayerStore, resume: bool) -> None:
        """A resumed run continues only a store it wrote last; a new run that continues
        another's store (``continue_store``) records the hand-over in it."""
        handovers = check_owner(store, self.location, self.run_id, resume)
        if handovers is not None:
            self._stamp = {**self._identity(), "handovers": handovers}

    def _identity(self) -> dict:
        return identity(self.run_id, self.run_dir, self.optimizer_id, self.rate)

    def _settle_pending(self, store: LayerStore) -> None:
        """Deferred (lazy) updates the store holds were made at the rate its last commit
        records; a run at another rate (a hand-over, a rollback with a new ``lr``) applies
        them first at that rate, as the steps that made them would have (applied at this
        run's rate they would change steps already committed)."""
        theirs = store.extra.get("rate")
        if (not store.extra.get("pending") or theirs is None or self.rate is None
                or theirs == self.rate or self.optimizer_config is None):
            return
        from jaxstream.experiment.optimizers import build_optimizer

        old = build_optimizer(self.optimizer_config, theirs["lr"], theirs.get("total_steps"))
        ex = self._new_executor(store, old)
        try:
            ex.flush()
        finally:
            ex.close()

    def _micro(self, batch: dict) -> dict:
        micro = split_micro_batches(batch, self.micro_batches)
        return jax.tree.map(lambda a: a[None], micro) if self.micro_batches == 1 else micro

    def step(self, state: StreamState, batch: dict, key: jax.Array) -> tuple[StreamState, dict]:
        """One committed step. A step that would commit non-finite values commits nothing and
        reports a NaN loss (the store keeps its last finite step)."""
        ex = self._executor()
        s = int(state.step)
        if ex.store.step != s:
            raise StoreError(f"the layer store at {self.location} is at step {ex.store.step}, the "
                             f"run at step {s}: another process wrote it, or it is not this run's "
                             "store")
        try:
            m = ex.step(self._micro(batch), key, step=s,
                        extra=lambda loss: {**self._stamp, "loss_finite": math.isfinite(loss)})
        except (StoreNonFiniteError, StoreDivergedError):
            return state, {"loss": float("nan"), "nonfinite_refused": 1.0}
        except StoreCorruptError as err:
            raise damaged(err, ex.store) from err
        guard = {} if ex.store.sane_step == s + 1 else {"guard_failed": 1.0}
        return StreamState(jnp.asarray(s + 1, jnp.int32)), {**guard,
            "loss": m["loss"], "stall_time": m["stall_s"], "layers_read": float(m["layers_read"]),
            "host_update_time": m["host_update_s"], "update_wait_time": m["wait_update_s"],
            "write_wait_time": m["wait_write_s"],
            **data_bytes(m),
            **{k: float(v) for k, v in m.items() if k in ("ticks", "fill_ratio")}}

    def settle(self) -> None:
        """Waits until the last step's commit is on disk (``async_commit``): the runner calls
        it before a checkpoint, which must never be ahead of the store it stands for."""
        if self.executor is not None:
            self.executor.store.settle()

    def warm_up(self, state: StreamState, batch: dict, key: jax.Array) -> None:
        """Compiles the step's kernels (its sweeps and the host updates) on ``batch`` without
        committing: the store keeps its step (see :meth:`StreamedExecutor.warm_up`)."""
        ex = self._executor()
        try:
            ex.warm_up(self._micro(batch), key, step=int(state.step))
        except StoreCorruptError as err:
            raise damaged(err, ex.store) from err

    #: :meth:`estimate` streams on the host (not jittable): diagnostics call it as it is
    host_estimate = True

    def estimate(self, state: StreamState, batch: dict, key: jax.Array):
        ex = self._executor()
        loss, grads = ex.estimate(self._micro(batch), key, step=int(state.step))
        return jnp.asarray(loss), jax.tree.map(jnp.asarray, grads)

    def params(self, state: StreamState) -> Any:
        """All parameters of the step ``state`` holds, read from the store (pending lazy
        updates applied first); an error if the store is at another step."""
        ex = self._executor()
        if ex.store.step != int(state.step):
            raise StoreError(f"parameters of step {int(state.step)} were asked for, the store at "
                             f"{self.location} holds step {ex.store.step}")
        ex.flush()
        return jax.tree.map(jnp.asarray, ex.store.read_params())
