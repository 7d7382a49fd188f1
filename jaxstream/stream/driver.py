"""The one driver of every streamed sweep (DESIGN §9): embed → block units → head (or back),
each unit's parameters loaded ``prefetch`` ahead while the one before computes, the
placement's block units walked in order and landed before the last unit."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from jaxstream.stream.prefetch import Event, Prefetcher
from jaxstream.stream.units import EMBED, HEAD, Unit


class Driver:
    """The sweep driver a streamed executor is built on: it needs ``self.placement`` (a
    :class:`~jaxstream.stream.placement.Placement`), ``self.cfg.prefetch`` and
    ``self.events`` (the step's read events, appended as each sweep ends).

    Example (a sweep applying each unit, as :mod:`jaxstream.stream.sweeps` write them)::

        state = ex._drive(layers, ex._load, t0, "forward", end, blocks)
    """

    placement: Any
    cfg: Any
    events: list[Event]
    _latest: Any = None  # the last unit's outputs: the device work dispatched last
    _loaders: ThreadPoolExecutor | None = None  # the prefetch threads, kept across sweeps

    def _pool(self) -> ThreadPoolExecutor:
        """The prefetch threads every sweep loads on (started once, not per sweep)."""
        if self._loaders is None:
            self._loaders = ThreadPoolExecutor(max(1, self.cfg.prefetch),
                                               thread_name_prefix="jaxstream-prefetch")
        return self._loaders

    def _end_loaders(self) -> None:
        """Ends the prefetch threads (after the sweeps: none is loading)."""
        if self._loaders is not None:
            self._loaders.shutdown(wait=True)
            self._loaders = None

    def _to_device(self, tree: Any) -> Any:
        return self.placement.to_device(tree)

    def _units(self, layers: Sequence[int]) -> list[Unit]:
        """A sweep's units: the embed, the placement's block units of ``layers``, the head."""
        return [EMBED, *self.placement.chunks(layers), HEAD]

    def _sweep(self, units: Sequence[Unit], load: Callable, t0: float, name: str,
               fence: Callable | None = None):
        pf = Prefetcher(load, units, self.cfg.prefetch, t0, name, fence, self._pool())
        for item in pf:
            self.placement.progress()
            yield item
        self.events.extend(pf.events)

    def _drive(self, layers: Sequence[int], load: Callable, t0: float, name: str,
               end: Callable, blocks: Callable, done: Callable | None = None,
               state: Any = None, reverse: bool = False) -> Any:
        """One embed → blocks → head sweep over ``layers`` (head → blocks → embed with
        ``reverse``), the one driver of every sweep: ``end(unit, loaded, state)`` runs the
        embed and the head, ``blocks(unit, loaded, state)`` a block unit, each returning
        ``(state, done)``; before the last unit the placement lands the blocks' pass
        (:meth:`Placement.land`). ``done(list of (unit, gradient))`` receives the gradients as
        they complete. Returns the last unit's state."""
        units = self._units(layers)
        last = units[0] if reverse else units[-1]
        self._latest = state  # what loads wait for: the device runs ahead by the prefetch depth
        for u, loaded in self._sweep(units[::-1] if reverse else units, load, t0, name,
                                     lambda: self._latest):
            with jax.profiler.TraceAnnotation(f"{name} {u}"):
                state, finished = self._unit(u, loaded, state, blocks, end, done, last)
            self._latest = state
            if done is not None:
                done(finished)
        return state

    def _unit(self, u: Unit, loaded: Any, state: Any, blocks: Callable, end: Callable,
              done: Callable | None, last: Unit) -> tuple:
        """One unit of :meth:`_drive`: ``(state, finished)``."""
        if u.is_block:
            return blocks(u, loaded, state)
        if u == last:
            state, landed = self.placement.land(state)
            if done is not None:
                done(landed)
        return end(u, loaded, state)

    def _cast_batch(self, batch: dict) -> dict:
        return self.placement.cast_batch(batch)

    def _each(self, u: Unit, g: Any, host: Any, fn: Callable) -> None:
        """``fn(store address, gradient, host params)`` for each layer of unit ``u`` (the
        embed's and the head's own)."""
        if not u.is_block:
            return fn(u.key, g, host)
        self.placement.split(u, g, host, fn)
