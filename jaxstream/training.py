"""A jitted training step from an estimator and an optax optimizer: a notebook's loop in 3 lines.

Example:
    >>> step = jaxstream.train_step(jaxstream.grad.forward(num_tangents=4), optax.adam(1e-3),
    ...                             stack)
    >>> opt_state = step.init(params)
    >>> for s in range(100):
    ...     params, opt_state, loss = step(params, opt_state, batch_at(s), jax.random.key(s))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

from jaxstream.grad.checks import check_key, check_loss_fn
from jaxstream.models.sequential import DROPOUT, Sequential
from jaxstream.optim.promotion import standard_promotion


class WithModelState(NamedTuple):
    """Optimizer state plus a model's non-differentiated state (BatchNorm running averages)."""

    optimizer: Any
    model: Any


class TrainStep:
    """``step(params, opt_state, batch, key) -> (params, opt_state, loss)``, compiled once.

    ``step.init(params)`` gives the matching ``opt_state`` (for a model with batch statistics it
    also carries them: ``opt_state.model``, for ``model.apply(params, x, opt_state.model)``).
    ``key``: ``jax.random.key(seed)``, or a legacy ``jax.random.PRNGKey(seed)`` (the same key,
    as every estimator accepts it).
    """

    def __init__(self, estimator: Callable, optimizer: optax.GradientTransformation,
                 loss_fn: Callable, prepare: Callable[[Any], Any] | None = None):
        """``prepare``: applied to each batch inside the step before the estimator sees it
        (e.g. the experiment runner's cut into micro-batches)."""
        if not callable(estimator):
            raise TypeError(f"estimator: expected an estimator such as jaxstream.grad.forward(), "
                            f"got {type(estimator).__name__}")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise TypeError(f"optimizer: expected an optax GradientTransformation, got "
                            f"{type(optimizer).__name__}")
        check_loss_fn(loss_fn, "train_step")
        self.estimator, self.loss_fn, self.prepare = estimator, loss_fn, prepare
        self.optimizer = standard_promotion(optimizer)  # optax's arithmetic: optax's rules
        self.stateful = isinstance(loss_fn, Sequential) and loss_fn.has_state
        self._step = jax.jit(self._update)

    def init(self, params: Any) -> Any:
        """The optimizer state for ``params`` (plus the model state where there is one)."""
        opt = self.optimizer.init(params)
        return WithModelState(opt, self.loss_fn.state) if self.stateful else opt

    def gradients(self, params: Any, batch: Any, key: jax.Array) -> tuple[jax.Array, Any]:
        """``(loss, grads)`` of the estimator; a sequential model gets its dropout key (the
        estimator runs activity perturbation on its own layered pass)."""
        model = self.loss_fn
        if self.prepare is not None:
            batch = self.prepare(batch)
        if isinstance(model, Sequential):
            model = model.with_rng(jax.random.fold_in(key, DROPOUT))
        out = self.estimator(model, params, batch, key)
        return out[0], out[1]

    def update(self, params: Any, opt_state: Any, batch: Any, key: jax.Array
               ) -> tuple[Any, Any, jax.Array, Any]:
        """One step, traceable (the engines jit it inside their own steps): ``(params,
        opt_state, loss, grads)``."""
        loss, grads = self.gradients(params, batch, key)
        opt = opt_state.optimizer if self.stateful else opt_state
        updates, opt = self.optimizer.update(grads, opt, params)
        if self.stateful:
            model_state = self.loss_fn.update_state(params, opt_state.model, batch["x"])
            opt = WithModelState(opt, model_state)
        return optax.apply_updates(params, updates), opt, loss, grads

    def _update(self, params, opt_state, batch, key):
        return self.update(params, opt_state, batch, key)[:3]

    def __call__(self, params: Any, opt_state: Any, batch: Any,
                 key: jax.Array) -> tuple[Any, Any, jax.Array]:
        check_key(key, "train_step")
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):  # jax.random.PRNGKey(s):
            key = jax.random.wrap_key_data(key)  # the same key as jax.random.key(s), typed
        return self._step(params, opt_state, batch, key)


def train_step(estimator: Callable, optimizer: optax.GradientTransformation,
               loss_fn: Callable) -> TrainStep:
    """A jitted ``(params, opt_state, batch, key) -> (params, opt_state, loss)``.

    Args:
      estimator: e.g. ``jaxstream.grad.backprop()`` or ``jaxstream.grad.forward(...)``.
      optimizer: an optax ``GradientTransformation`` (learning rate included).
      loss_fn: the model: a :class:`~jaxstream.models.Stack`, a
        :class:`~jaxstream.models.sequential.Sequential` or any ``(params, batch) -> scalar``.

    Returns:
      a :class:`TrainStep`; ``step.init(params)`` makes the first ``opt_state``.

    Example:
      >>> step = train_step(jaxstream.grad.backprop(), optax.adam(1e-2), stack)
      >>> opt_state = step.init(params)
      >>> params, opt_state, loss = step(params, opt_state, batch, jax.random.key(0))
    """
    return TrainStep(estimator, optimizer, loss_fn)
