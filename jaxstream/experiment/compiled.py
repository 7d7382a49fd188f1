"""Per-process cache of built models, local engines and their jitted functions.

Runs with the same model / estimator / optimizer in one process (a sweep, a notebook, a resumed
run, a test) then reuse compiled steps instead of recompiling. Only engines whose state lives
wholly in the state pytree (``local``) are cached; engines holding host state are rebuilt.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstream.experiment.config import ConfigError
from jaxstream.experiment.engines import LocalEngineConfig, build_engine, tree_cosine
from jaxstream.experiment.optimizers import build_optimizer
from jaxstream.experiment.train_config import ArmConfig, TrainConfig
from jaxstream.models import to_stack

_CACHE: dict[tuple, Any] = {}
_MAX_ENTRIES = 64


def _cached(key: tuple, make: Callable[[], Any]) -> Any:
    if key not in _CACHE:
        if len(_CACHE) >= _MAX_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = make()
    return _CACHE[key]


def model_for(cfg: TrainConfig, info: dict[str, int], x: Any = None) -> Any:
    """The model of ``cfg.model`` for data ``info`` (same object for equal configs). For an
    engine that places or streams blocks (``places_blocks``) a sequential model becomes a stack
    (:func:`jaxstream.models.to_stack`; ``x``, a few training inputs, fixes a padded stack's
    shapes)."""
    staged = cfg.engine.places_blocks

    def make():
        model = cfg.model.build(info)
        if getattr(model, "has_state", False):
            raise ConfigError(f"model: {type(cfg.model).__name__} builds a model with batch "
                              "statistics (BatchNorm); the runner's engines do not carry running "
                              "averages, so its evaluations would use the initial ones: remove "
                              "BatchNorm, or train it with js.train_step in your own loop")
        return to_stack(model, x) if staged else model

    shape = None if x is None else (tuple(np.shape(x)), str(np.asarray(x).dtype))
    return _cached(("model", repr(cfg.model), tuple(sorted(info.items())), staged, shape), make)


def evaluator_for(stack: Any) -> Callable:
    """``jit((params, batch) -> (mean loss, accuracy))`` for ``stack``."""

    def make():
        def evaluate(params, batch):
            logits = stack.apply(params, batch["x"])
            loss = jnp.mean(stack.example_loss(logits, batch))
            acc = jnp.mean(jnp.argmax(logits, axis=-1) == batch["y"])
            return loss, acc

        return jax.jit(evaluate)

    return _cached(("eval", id(stack)), make)


def engine_for(cfg: TrainConfig, arm: ArmConfig, stack: Any, example_batch: dict | None = None
               ) -> Any:
    """The engine that trains ``arm`` (cached for the ``local`` engine). ``example_batch``:
    one batch of the data, for engines whose state takes shapes from it (not the config's
    data, which an engine never loads itself)."""
    opt_cfg = cfg.arm_optimizer(arm)
    n_micro = getattr(arm.estimator, "micro_batches", 1)

    def make():
        tx = build_optimizer(opt_cfg, arm.lr, cfg.steps)
        return build_engine(cfg.engine, stack=stack, estimator=arm.estimator.build(),
                            optimizer=tx, optimizer_config=opt_cfg, learning_rate=arm.lr,
                            total_steps=cfg.steps, model=cfg.model, arm=arm.name,
                            micro_batches=n_micro, example_batch=example_batch)

    if type(cfg.engine) is not LocalEngineConfig:
        return make()
    needs_steps = opt_cfg.schedule != "constant" or opt_cfg.warmup_steps
    key = ("engine", id(stack), repr(arm.estimator), repr(opt_cfg), arm.lr,
           cfg.steps if needs_steps else None, repr(cfg.engine))
    return _cached(key, make)


def diagnostics_for(engine: Any, stack: Any) -> Callable | None:
    """``diag(state, batch, key) -> {"cosine", "norm_ratio", "diag_*"}``: the step's estimate
    against the exact gradient of the same batch, plus the estimator's scalar diagnostics (e.g.
    ``diag_beta`` of the weighted hybrid); None if the engine has no ``estimate``."""
    estimate = getattr(engine, "estimate", None)
    if estimate is None:
        return None

    try:
        with_diag = "diagnostics" in inspect.signature(estimate).parameters
    except (TypeError, ValueError):
        with_diag = False

    def make():
        def diag(state, batch, key):
            extra = {}
            if with_diag:
                _, g, info = estimate(state, batch, key, diagnostics=True)
                extra = _scalar_diagnostics(info)
            else:
                _, g = estimate(state, batch, key)
            ge = jax.grad(stack)(engine.params(state), batch)
            ratio = optax.tree.norm(g) / (optax.tree.norm(ge) + 1e-30)
            return {"cosine": tree_cosine(g, ge), "norm_ratio": ratio, **extra}

        jitted = jax.jit(diag)
        return lambda *a: {k: float(v) for k, v in jax.device_get(jitted(*a)).items()}

    return _cached(("diag", id(engine)), make)


def _is_scalar(v: Any) -> bool:
    """A numeric array with one element."""
    return (hasattr(v, "dtype") and hasattr(v, "size") and v.size == 1
            and jnp.issubdtype(v.dtype, jnp.number))


def _scalar_diagnostics(info: dict) -> dict[str, jax.Array]:
    """Scalars of an estimator's diag dict as ``diag_<name>``; a dict of floating arrays (e.g. a
    per-layer shrinkage ``beta``) as its mean ``diag_<name>_mean``. Per-sample arrays are skipped."""
    out = {}
    for k, v in info.items():
        if _is_scalar(v):
            out[f"diag_{k}"] = jnp.reshape(v, ()).astype(jnp.float32)
        elif isinstance(v, dict):
            leaves = jax.tree.leaves(v)
            if leaves and all(hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
                              for x in leaves):
                flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
                out[f"diag_{k}_mean"] = jnp.mean(flat)
    return out
