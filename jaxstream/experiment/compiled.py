"""Per-process cache of built models, local engines and their jitted functions.

Runs with the same model / estimator / optimizer in one process (a sweep, a notebook, a resumed
run, a test) then reuse compiled steps instead of recompiling. The caches are
``functools.lru_cache``, keyed by the configs themselves (frozen dataclasses, hashable) and by
the built objects (by identity). Only engines whose state lives wholly in the state pytree
(``local``) are cached; engines holding host state are rebuilt.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxstream.experiment.config import ConfigError, plugin_call
from jaxstream.experiment.engines import LocalEngineConfig, build_engine, tree_cosine
from jaxstream.experiment.model_configs import ModelConfig
from jaxstream.experiment.optimizers import build_optimizer
from jaxstream.experiment.train_config import ArmConfig, TrainConfig
from jaxstream.grad import local_targets
from jaxstream.models import to_stack
from jaxstream.models.stack import is_stack_params

_ENTRIES = 64  # per cache


def model_for(cfg: TrainConfig, info: dict[str, int], x: Any = None) -> Any:
    """The model of ``cfg.model`` for data ``info`` (same object for equal configs). For an
    engine that places or streams blocks (``places_blocks``) a sequential model becomes a stack
    (:func:`jaxstream.models.to_stack`; ``x``, a few training inputs, fixes a padded stack's
    shapes: only its shape and dtype are read)."""
    spec = None if x is None else jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
    return _model(cfg.model, tuple(sorted(info.items())), cfg.engine.places_blocks, spec)


@functools.lru_cache(maxsize=_ENTRIES)
def _model(model_cfg: Any, info: tuple, staged: bool, x: jax.ShapeDtypeStruct | None) -> Any:
    model = plugin_call("model", ModelConfig, model_cfg, model_cfg.build, dict(info))
    if getattr(model, "has_state", False):
        raise ConfigError(f"model: {type(model_cfg).__name__} builds a model with batch "
                          "statistics (BatchNorm); the runner's engines do not carry running "
                          "averages, so its evaluations would use the initial ones: remove "
                          "BatchNorm, or train it with js.train_step in your own loop")
    dropped = [l for l, layer in enumerate(getattr(model, "layers", ()))
               if getattr(layer, "has_dropout", False)]
    if dropped:  # without a step key its masks would be off: trained without, silently
        raise ConfigError(
            f"model: layer {dropped[0]} holds nnx.Dropout, which the runner's engines do not "
            "drive (they bind no step key, so it would train with dropout silently off): "
            "remove the dropout, or train the model with js.train_step, which binds the "
            "step key")
    try:  # a layer the engines cannot drive (its own RNG streams), a model not stackable
        if x is not None and hasattr(model, "check_layers"):
            model.check_layers(x)
        return to_stack(model, x) if staged else model
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("model") else f"model: {e}") from None


@functools.lru_cache(maxsize=_ENTRIES)
def evaluator_for(stack: Any) -> Callable:
    """``jit((params, batch) -> (mean loss, accuracy))`` for ``stack``."""

    def evaluate(params, batch):
        logits = stack.apply(params, batch["x"])
        loss = jnp.mean(stack.example_loss(logits, batch))
        acc = jnp.mean(jnp.argmax(logits, axis=-1) == batch["y"])
        return loss, acc

    return jax.jit(evaluate)


def engine_for(cfg: TrainConfig, arm: ArmConfig, stack: Any, example_batch: dict | None = None
               ) -> Any:
    """The engine that trains ``arm`` (cached for the ``local`` engine). ``example_batch``:
    one batch of the data, for engines whose state takes shapes from it (not the config's
    data, which an engine never loads itself)."""
    opt_cfg = cfg.arm_optimizer(arm)
    n_micro = arm.estimator.micro_batches
    if type(cfg.engine) is LocalEngineConfig:  # its step reads none of the other arguments
        needs_steps = opt_cfg.schedule != "constant" or opt_cfg.warmup_steps
        return _local_engine(cfg.engine, stack, arm.estimator, opt_cfg, arm.lr,
                             cfg.steps if needs_steps else None, n_micro)
    tx = build_optimizer(opt_cfg, arm.lr, cfg.steps)
    return build_engine(cfg.engine, stack=stack, estimator=arm.estimator.build(),
                        optimizer=tx, optimizer_config=opt_cfg, learning_rate=arm.lr,
                        total_steps=cfg.steps, model=cfg.model, arm=arm.name,
                        micro_batches=n_micro, example_batch=example_batch)


@functools.lru_cache(maxsize=_ENTRIES)
def _local_engine(engine_cfg: LocalEngineConfig, stack: Any, estimator_cfg: Any, opt_cfg: Any,
                  lr: float, steps: int | None, n_micro: int) -> Any:
    tx = build_optimizer(opt_cfg, lr, steps)
    return build_engine(engine_cfg, stack=stack, estimator=estimator_cfg.build(), optimizer=tx,
                        optimizer_config=opt_cfg, learning_rate=lr, total_steps=steps,
                        micro_batches=n_micro)


def diagnostics_for(engine: Any, stack: Any, local: bool = False) -> Callable | None:
    """``diag(state, batch, key) -> {"cosine", "norm_ratio", "diag_*", ...}``: the step's
    estimate against the exact gradient of the same batch, plus the estimator's scalar
    diagnostics (e.g. ``diag_beta`` of the weighted hybrid); None if the engine has no
    ``estimate``. On a stack, also per segment: ``cosine_embed``, ``cosine_block_<l>``,
    ``cosine_head``; with ``local`` (an estimator that follows local losses) the same against
    the local target (:func:`jaxstream.grad.local_targets`) as ``local_cosine_*``: noise and
    the local losses' bias, told apart layer by layer."""
    return _diagnostics(engine, stack, local) if hasattr(engine, "estimate") else None


@functools.lru_cache(maxsize=_ENTRIES)
def _diagnostics(engine: Any, stack: Any, local: bool) -> Callable:
    estimate = engine.estimate
    try:
        with_diag = "diagnostics" in inspect.signature(estimate).parameters
    except (TypeError, ValueError):
        with_diag = False

    def estimated(state, batch, key):
        if with_diag:
            _, g, info = estimate(state, batch, key, diagnostics=True)
            return g, _scalar_diagnostics(info)
        return estimate(state, batch, key)[1], {}

    def against_exact(g, extra, params, batch):
        ge = jax.grad(stack)(params, batch)
        ratio = optax.tree.norm(g) / (optax.tree.norm(ge) + 1e-30)
        out = {"cosine": tree_cosine(g, ge), "norm_ratio": ratio, **extra}
        if is_stack_params(params):
            out.update(segment_cosines("cosine", g, ge))
            if local:
                out.update(segment_cosines("local_cosine", g,
                                           local_targets(stack, params, batch)))
        return out

    if getattr(engine, "host_estimate", False):  # the engine's estimate runs on the host (a
        compare = jax.jit(against_exact)          # streamed sweep): only the comparison jits

        def host(state, batch, key):
            g, extra = estimated(state, batch, key)
            return _host_record(jax.device_get(compare(g, extra, engine.params(state), batch)))
        return host

    def diag(state, batch, key):
        g, extra = estimated(state, batch, key)
        return against_exact(g, extra, engine.params(state), batch)

    jitted = jax.jit(diag)
    return lambda *a: _host_record(jax.device_get(jitted(*a)))


def segment_cosines(name: str, a: Any, b: Any) -> dict[str, jax.Array]:
    """Cosines of two stack-shaped trees per segment: ``<name>_embed``, ``<name>_head`` and
    ``<name>_blocks`` (one per block, an (L,) array); a segment with its own local head is
    compared on its module (its head's global gradient is zero)."""
    part = lambda t: t["module"] if isinstance(t, dict) and "local_head" in t else t
    return {f"{name}_embed": tree_cosine(part(a["embed"]), part(b["embed"])),
            f"{name}_blocks": jax.vmap(tree_cosine)(part(a["blocks"]), part(b["blocks"])),
            f"{name}_head": tree_cosine(a["head"], b["head"])}


def _host_record(out: dict) -> dict[str, float]:
    """Plain floats; an (L,) ``*_blocks`` array as ``*_block_<l>``."""
    record = {}
    for k, v in out.items():
        if k.endswith("_blocks"):
            record.update({f"{k[:-1]}_{l}": float(x) for l, x in enumerate(np.ravel(v))})
        else:
            record[k] = float(v)
    return record


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
