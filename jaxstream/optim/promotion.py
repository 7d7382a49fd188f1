"""An optax optimizer traced under JAX's standard dtype promotion, whatever the caller's mode.

optax's own arithmetic raises a Python float to an int32 step count (Adam's bias correction),
which strict promotion (``jax.numpy_dtype_promotion("strict")``) refuses. The engines wrap the
optimizer they are given, so a run or a test under strict promotion checks the library's own
code and leaves the optimizer's to optax.

Example:
    >>> tx = standard_promotion(optax.adam(1e-3))
    >>> with jax.numpy_dtype_promotion("strict"):
    ...     updates, state = tx.update(grads, tx.init(params), params)
"""

from __future__ import annotations

from typing import Any

import jax
import optax


def standard_promotion(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with its ``init`` and ``update`` traced under standard dtype promotion; its
    state is ``tx``'s own, unchanged. Wrapping twice is wrapping once."""
    if getattr(tx, "_standard_promotion", False):
        return tx

    def init(params: Any) -> Any:
        with jax.numpy_dtype_promotion("standard"):
            return tx.init(params)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(updates, state, params, **extra)

    return _Wrapped(init, update)


class _Wrapped(optax.GradientTransformationExtraArgs):
    """A wrapped optimizer (marked so that it is not wrapped again)."""

    _standard_promotion = True
