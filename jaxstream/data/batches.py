"""Mini-batches as a pure function of (seed, step), so a resumed run sees the same data."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffle of ``n`` examples used in ``epoch`` (seeded by (seed, epoch))."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """Indices of batch ``step``: positions ``step*B .. step*B+B-1`` of the epoch-wise shuffles.

    Every epoch visits each example once; a batch may straddle two epochs.

    Example:
      >>> batch_indices(10, 4, seed=0, step=2)   # positions 8..11: epoch 0 end, epoch 1 start
    """
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    if n < 1:
        raise ValueError("the data set is empty")
    if batch_size > n:
        raise ValueError(f"batch_size: {batch_size} exceeds the {n} examples of the data set (a "
                         f"batch would hold some examples twice); allowed: 1..{n}")
    pos = step * batch_size + np.arange(batch_size)
    epochs = pos // n
    out = np.empty(batch_size, dtype=np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = epoch_permutation(n, seed, int(e))[pos[sel] % n]
    return out


def batch_at(data: dict[str, np.ndarray], batch_size: int, seed: int, step: int) -> dict:
    """Batch ``step`` of ``data`` (a dict of arrays with a common leading axis)."""
    n = len(next(iter(data.values())))
    idx = batch_indices(n, batch_size, seed, step)
    return {k: v[idx] for k, v in data.items()}


def iterate_batches(
    data: dict[str, np.ndarray], batch_size: int, seed: int, start: int = 0, stop: int | None = None
) -> Iterator[tuple[int, dict]]:
    """Yield ``(step, batch)`` for steps ``start, start+1, ...`` (up to ``stop``, exclusive)."""
    step = start
    while stop is None or step < stop:
        yield step, batch_at(data, batch_size, seed, step)
        step += 1
