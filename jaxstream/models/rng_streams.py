"""A layer's own ``nnx.Rngs`` streams, driven by the step key.

A module that draws from its own RNG streams (``self.rngs.noise()``, an attention module's
dropout, a recurrent cell's carry) mutates a counter when it draws; inside a trace flax refuses
that on the layer's stored state (``TraceContextError``). A :class:`~jaxstream.models.
sequential.Sequential` therefore merges every layer with a fresh copy of its streams and, in
training mode with a bound key, reseeds stream ``j`` of layer ``l`` to
``fold_in(fold_in(fold_in(rng, l), STREAMS), j)`` with its count at 0 (what ``nnx.reseed`` does,
one key per stream). Every pass of a step -- every tangent, the exact gradient, both passes of
activity perturbation -- then draws the same values, and the same key gives the same result on
every estimator. A draw in training mode without a bound key is refused by name (it would repeat
the layer's initial draw every step); evaluation draws from the layer's initial streams, the same
every call.

Example:
    >>> streams = own_streams(module)       # [(path, RngStream), ...] in graph order
    >>> seed_streams(streams, jax.random.key(0))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

STREAMS = 2**31 - 1  # key segment of a layer's own streams (after its dropout indices 0, 1, ...)


def own_streams(module: Any) -> list[tuple[tuple, nnx.RngStream]]:
    """The module's RNG streams (each shared stream once), in ``nnx.iter_graph`` order."""
    return [(tuple(path), node) for path, node in nnx.iter_graph(module)
            if isinstance(node, nnx.RngStream)]


def stray_rng_state(module: Any) -> tuple | None:
    """Path of an RNG variable (``RngKey``, ``RngCount``) held outside an ``nnx.Rngs`` stream,
    which no reseeding reaches; None if there is none."""
    streams = {path for path, _ in own_streams(module)}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.RngState) and tuple(path)[:-1] not in streams:
            return tuple(path)
    return None


def fresh(state: Any) -> Any:
    """A copy of ``state`` with new variables, created in the current trace (flax allows a
    stream to count up only in the trace that created its variables)."""
    return jax.tree.map(lambda a: a, state)


def seed_streams(streams: list[tuple[tuple, nnx.RngStream]], key: jax.Array) -> None:
    """Stream ``j`` gets the key ``fold_in(key, j)`` (split to its key's shape) and count 0."""
    for j, (_, stream) in enumerate(streams):
        k = jax.random.fold_in(key, j)
        shape = stream.key.get_value().shape
        stream.key.set_value(jax.random.split(k, shape) if shape else k)
        stream.count.set_value(jnp.zeros(shape, jnp.uint32))


def counts(streams: list[tuple[tuple, nnx.RngStream]]) -> list[Any]:
    """The streams' count values now (compared by identity: a draw replaces the value)."""
    return [stream.count.get_value() for _, stream in streams]


def drawn(streams: list[tuple[tuple, nnx.RngStream]], before: list[Any]) -> tuple | None:
    """Path of the first stream drawn from since ``before`` (:func:`counts`); None if none."""
    for (path, stream), old in zip(streams, before):
        if stream.count.get_value() is not old:
            return path
    return None
