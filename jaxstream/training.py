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
    The running averages are updated from the batch as the estimator's loss saw it: the whole
    batch, or, for a micro-batched estimator (``estimator.plan.micro_batches``: the hybrids,
    ``exact_subset``), the mean of every micro-batch's own update
    (:meth:`~jaxstream.models.Sequential.update_state` with ``micro_batched=True``), since
    BatchNorm normalised each micro-batch by its own statistics.
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
        self.micro_batched = is_micro_batched(estimator)
        self._step = jax.jit(self._update)

    def init(self, params: Any) -> Any:
        """The optimizer state for ``params`` (plus the model state where there is one)."""
        opt = self.optimizer.init(params)
        return WithModelState(opt, self.loss_fn.state) if self.stateful else opt

    def _bound(self, key: jax.Array) -> Callable:
        """The loss function of the step keyed ``key``: a sequential model gets its dropout key
        (the estimator runs activity perturbation on its own layered pass)."""
        model = self.loss_fn
        if isinstance(model, Sequential):
            model = model.with_rng(jax.random.fold_in(key, DROPOUT))
        return model

    def gradients(self, params: Any, batch: Any, key: jax.Array) -> tuple[jax.Array, Any]:
        """``(loss, grads)`` of the estimator on ``batch`` (``prepare`` applied)."""
        return self._gradients(params, self._prepared(batch), key)

    def _prepared(self, batch: Any) -> Any:
        return batch if self.prepare is None else self.prepare(batch)

    def _gradients(self, params: Any, batch: Any, key: jax.Array) -> tuple[jax.Array, Any]:
        out = self.estimator(self._bound(key), params, batch, key)
        return out[0], out[1]

    def update(self, params: Any, opt_state: Any, batch: Any, key: jax.Array
               ) -> tuple[Any, Any, jax.Array, Any]:
        """One step, traceable (the engines jit it inside their own steps): ``(params,
        opt_state, loss, grads)``."""
        batch = self._prepared(batch)
        loss, grads = self._gradients(params, batch, key)
        opt = opt_state.optimizer if self.stateful else opt_state
        updates, opt = self.optimizer.update(grads, opt, params)
        if self.stateful:  # from the batch as the loss saw it, with the same dropout masks
            model_state = self._bound(key).update_state(params, opt_state.model, batch["x"],
                                                       micro_batched=self.micro_batched)
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


def is_micro_batched(estimator: Callable) -> bool:
    """Whether the estimator's batch carries a leading micro-batch axis N, each micro-batch
    fed to the loss on its own (its ``plan.micro_batches``; False for a plain callable)."""
    return bool(getattr(getattr(estimator, "plan", None), "micro_batches", False))


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
