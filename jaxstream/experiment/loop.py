"""One training loop with hooks: every experiment kind that trains step by step runs it.

The loop owns only what every step does: take the batch and the key of step ``s`` (pure
functions of ``s``), call the engine's step, time it and turn its metrics into a record.
Evaluation, diagnostics, logging, checkpoints and progress are hooks, each run every N steps
(as levanter's ``trainer.add_hook(fn, every=N)``). Where a run starts is decided by start hooks
(:meth:`TrainLoop.add_start_hook`, run by :meth:`TrainLoop.begin`): :class:`Resume` continues
from the latest checkpoint, an engine's ``resume_at`` reconciles parameters kept outside it (a
layer store). The engine state is a pytree passed in and returned; the loop keeps none of it.

Example:
    >>> loop = TrainLoop(engine.step, batch_at=lambda s: batches[s],
    ...                  key_at=lambda s: jax.random.fold_in(key, s))
    >>> loop.add_hook(evaluate, every=50, at=(1000,))          # also at the final step
    >>> loop.add_hook(lambda info: log.append(info.record))   # every step
    >>> loop.add_hook(save_checkpoint, every=100, at_end=True)
    >>> resume = Resume(checkpointer)                         # --resume: latest checkpoint
    >>> loop.add_start_hook(resume)
    >>> state, start = loop.begin(state)
    >>> state, step, stopped, train_time = loop.run(state, start=start, stop=1000,
    ...                                             train_time=resume.train_time)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np


@dataclasses.dataclass
class StepInfo:
    """What a hook sees.

    Attributes:
      step: steps done, counting this one (1-based: the step that took state ``s`` to ``s+1``).
      state: the engine state after the step (before it, for hooks added with ``before=True``).
      batch: the step's batch.
      key: the step's key.
      record: the step's record (tags, ``step``, metrics, ``step_time``, ``train_time``);
        hooks may add fields to it, later hooks see them.
      last: whether this is the loop's last step (``stop`` reached or ``stop_if`` true).
    """

    step: int
    state: Any
    batch: Any
    key: jax.Array
    record: dict[str, Any]
    last: bool


@dataclasses.dataclass(frozen=True)
class Hook:
    """``fn`` run at steps that are multiples of ``every`` (0: none), at the steps in ``at``,
    and on the last step if ``at_end``; before the engine step if ``before``."""

    fn: Callable[[StepInfo], None]
    every: int = 1
    at: tuple[int, ...] = ()
    at_end: bool = False
    before: bool = False

    def due(self, step: int, last: bool) -> bool:
        return ((self.every > 0 and step % self.every == 0) or step in self.at
                or (self.at_end and last))


class LoopResult(NamedTuple):
    state: Any         # the engine state after the last step run
    step: int          # steps done
    stopped: bool      # ``stop_if`` ended the loop early
    train_time: float  # seconds in engine steps (hooks excluded), including ``train_time`` given
                       # (the given value unchanged when the loop is not ``timed``)


def host_value(v: Any) -> Any:
    """A metric on the host: a float for a scalar, a NumPy array otherwise."""
    a = np.asarray(v)
    return float(a) if a.ndim == 0 else a


class TrainLoop:
    """Runs ``step(state, batch, key) -> (state, metrics)`` from ``start`` to ``stop``.

    Args:
      step: the engine's step; ``metrics`` is a dict of scalars (or arrays, one per lane).
      batch_at: ``s -> batch`` of step ``s`` (0-based).
      key_at: ``s -> key`` of step ``s``.
      tags: fields put first in every record (e.g. ``{"arm": "backprop"}``).
      stop_if: ``record -> bool``; true ends the loop after that step (e.g. a non-finite loss).
      timed: fetch the metrics after every step and time it (``step_time``, ``train_time``);
        False leaves them on the device (JAX arrays) so the next step is dispatched at once.
    """

    def __init__(self, step: Callable, *, batch_at: Callable[[int], Any],
                 key_at: Callable[[int], jax.Array], tags: dict[str, Any] | None = None,
                 stop_if: Callable[[dict], bool] | None = None, timed: bool = True):
        self.step, self.batch_at, self.key_at = step, batch_at, key_at
        self.timed = timed
        self.tags = dict(tags or {})
        self.stop_if = stop_if
        self.hooks: list[Hook] = []
        self.start_hooks: list[Callable[[Any, int], tuple[Any, int]]] = []

    def add_hook(self, fn: Callable[[StepInfo], None], *, every: int = 1,
                 at: tuple[int, ...] = (), at_end: bool = False, before: bool = False) -> None:
        """Run ``fn(info)`` every ``every`` steps (hooks run in the order they were added)."""
        self.hooks.append(Hook(fn, every, tuple(at), at_end, before))

    def add_start_hook(self, fn: Callable[[Any, int], tuple[Any, int]]) -> None:
        """Run ``fn(state, start) -> (state, start)`` in :meth:`begin` (in the order added)."""
        self.start_hooks.append(fn)

    def begin(self, state: Any, start: int = 0) -> tuple[Any, int]:
        """The state and step to run from: ``(state, start)`` passed through the start hooks."""
        for fn in self.start_hooks:
            state, start = fn(state, start)
        return state, start

    def run(self, state: Any, *, start: int, stop: int, train_time: float = 0.0) -> LoopResult:
        """Steps ``start+1 .. stop`` (fewer if ``stop_if`` fires); returns the new state."""
        step, stopped = start, False
        before = [h for h in self.hooks if h.before]
        after = [h for h in self.hooks if not h.before]
        for s in range(start, stop):
            step = s + 1
            batch, key = self.batch_at(s), self.key_at(s)
            info = StepInfo(step, state, batch, key, {**self.tags, "step": step}, step == stop)
            for h in before:
                if h.due(step, info.last):
                    h.fn(info)
            t0 = time.perf_counter()
            state, metrics = self.step(state, batch, key)
            if self.timed:
                metrics = {k: host_value(v) for k, v in jax.device_get(metrics).items()}
                dt = time.perf_counter() - t0
                train_time += dt
                metrics.update(step_time=dt, train_time=train_time)
            info.record.update(metrics)
            stopped = self.stop_if is not None and bool(self.stop_if(info.record))
            info.state, info.last = state, info.last or stopped
            for h in after:
                if h.due(step, info.last):
                    h.fn(info)
            if stopped:
                break
        return LoopResult(state, step, stopped, train_time)


class Resume:
    """Start hook: continue from the checkpointer's latest save (if any).

    ``checkpointer`` has ``restore_latest(like) -> (step | None, state, meta)`` (e.g.
    :class:`jaxstream.experiment.checkpoints.ArmCheckpointer`); after :meth:`TrainLoop.begin`,
    ``meta`` holds the saved metadata (``train_time``, ``diverged``).

    Example:
        >>> resume = Resume(ArmCheckpointer(run_dir / "checkpoints" / "backprop"))
        >>> loop.add_start_hook(resume)
        >>> state, start = loop.begin(state)   # start: the checkpoint's step, or 0
    """

    def __init__(self, checkpointer: Any, sane: bool = False):
        """``sane``: resume from the latest checkpoint saved before the run diverged (``--rollback``)
        instead of the latest one."""
        self.checkpointer = checkpointer
        self.sane = sane
        self.meta: dict[str, Any] = {}

    def __call__(self, state: Any, start: int) -> tuple[Any, int]:
        if self.sane:
            step, state, self.meta = self.checkpointer.restore_latest(
                state, where=lambda meta: not meta.get("diverged", False))
        else:
            step, state, self.meta = self.checkpointer.restore_latest(state)
        return state, step or start

    @property
    def train_time(self) -> float:
        """Seconds of engine steps before the checkpoint (0 without one)."""
        return float(self.meta.get("train_time", 0.0))

    @property
    def diverged(self) -> bool:
        """Whether the checkpointed run had diverged (it is then not continued)."""
        return bool(self.meta.get("diverged", False))


def resumed_records(kept: list[dict], start: int, tags: dict[str, Any]) -> list[dict]:
    """The records of steps ``0 .. start`` from an earlier session, in step order; a step done
    whose record the log lost gets ``{**tags, "step": k, "lost": True}``. A run that began on a
    store another run trained (its first record ``handed_over``) has no steps before that."""
    records = [r for r in kept if r["step"] <= start] if start else []
    logged = {r["step"] for r in records}
    first = min((r["step"] for r in records if r.get("handed_over")), default=0)
    records += [{**tags, "step": k, "lost": True} for k in range(first + 1, start + 1)
                if k not in logged]
    return sorted(records, key=lambda r: r["step"])
