"""Compare gradient estimators on the same model, batch and seeds against the exact gradient.

:func:`evaluate` runs one estimator over R keys (``jax.vmap``) and returns its
:class:`~jaxstream.quality.metrics.SeedStatistics`; :func:`compare` does it for several estimators
and returns a :class:`~jaxstream.quality.table.QualityTable` that prints and plots. The exact
reference is ``jaxstream.grad.backprop()`` on the same batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.quality.metrics import SeedStatistics, seed_statistics
from jaxstream.quality.table import QualityTable, rows_from_statistics

Estimator = Callable[..., tuple[jax.Array, Any]]
LossFn = Callable[[Any, Any], jax.Array]


def flatten_microbatches(batch: Any) -> Any:
    """Merge the leading micro-batch axis into the example axis: ``(N, B, ...) -> (N*B, ...)``.

    For a loss that is a mean over examples and equal micro-batches, the gradient on the merged
    batch is the gradient of the mean micro-batch loss (what a hybrid estimate targets).

    Example:
      >>> flatten_microbatches({"x": jnp.zeros((16, 8, 64))})["x"].shape
      (128, 64)
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    lead = [tuple(jnp.shape(a)[:2]) for _, a in leaves]
    for path, a in leaves:
        if jnp.ndim(a) < 2 or tuple(jnp.shape(a)[:2]) != max(lead, key=lead.count):
            raise ValueError(
                f"microbatched: the batch must be shaped (micro_batches, batch, ...) on every "
                f"leaf; leaf {jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(a))} "
                "(a flat batch: split it, e.g. x.reshape(n, -1, *x.shape[1:]))")
    return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), batch)


def exact_gradient(loss_fn: LossFn, params: Any, batch: Any) -> tuple[jax.Array, Any]:
    """``(loss, grads)`` of ``jaxstream.grad.backprop()``: the reference of every comparison."""
    import jaxstream.grad as jg

    return _backprop(jg.backprop(), loss_fn, params, batch)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _backprop(estimator: Estimator, loss_fn: LossFn, params: Any, batch: Any):
    return estimator(loss_fn, params, batch, None)


def _keys(seeds: int | jax.Array, seed: int = 0) -> jax.Array:
    if isinstance(seeds, bool) or not isinstance(seeds, (int, np.integer, np.ndarray, jax.Array)):
        raise TypeError(f"seeds: an int R >= 2 or an array of R keys, got {seeds!r}")
    if isinstance(seeds, (int, np.integer)):
        if seeds < 2:
            raise ValueError(f"seeds: need at least 2 seeds for bias/variance, got {seeds}")
        return jax.random.split(jax.random.key(seed), seeds)
    if seeds.shape[0] < 2:
        raise ValueError(f"seeds: need at least 2 keys, got {seeds.shape[0]}")
    return seeds


#: XLA options for the quality runs on CPU: backend optimisation level 0 compiles several
#: times faster (the estimators are compiled once per configuration and run only R times, so
#: compile time dominates); results agree to float32 rounding.
QUICK_COMPILE = {"xla_backend_optimization_level": 0}


def _vmapped_estimates(estimator: Estimator, loss_fn: LossFn, params: Any, batch: Any, keys):
    return jax.vmap(lambda k: estimator(loss_fn, params, batch, k)[1])(keys)


_estimates_default = jax.jit(_vmapped_estimates, static_argnums=(0, 1))
_estimates_quick = jax.jit(
    _vmapped_estimates, static_argnums=(0, 1), compiler_options=QUICK_COMPILE
)


def _estimates(estimator: Estimator, loss_fn: LossFn, params: Any, batch: Any, keys: jax.Array):
    quick = jax.default_backend() == "cpu"
    fn = _estimates_quick if quick else _estimates_default
    return fn(estimator, loss_fn, params, batch, keys)


def estimates_over_keys(
    estimator: Estimator, loss_fn: LossFn, params: Any, batch: Any, keys: jax.Array
) -> Any:
    """R gradient estimates (leading axis R), one per key, in one jitted ``vmap``.

    The estimator and ``loss_fn`` are static (hashable), so repeated calls with same-shaped
    inputs reuse the compiled function.

    Example:
      >>> grads = estimates_over_keys(jg.forward(), stack, params, batch, keys)
    """
    return _estimates(estimator, loss_fn, params, batch, keys)


_seed_statistics = jax.jit(seed_statistics)


def evaluate(
    estimator: Estimator,
    loss_fn: LossFn,
    params: Any,
    batch: Any,
    keys: jax.Array,
    exact: Any,
) -> SeedStatistics:
    """Seed statistics (bias, variance, SNR, cosine mean/std; per group) of one estimator.

    Args:
      estimator: ``estimator(loss_fn, params, batch, key) -> (loss, grads)``.
      loss_fn: ``loss_fn(params, batch) -> scalar`` (a ``Stack`` or any function).
      params: the point where gradients are estimated.
      batch: what the estimator is given.
      keys: R >= 2 PRNG keys.
      exact: the exact gradient the estimates are compared with.

    Returns:
      :class:`SeedStatistics` of the R estimates.

    Example:
      >>> stats = evaluate(jg.forward(), stack, params, batch, keys, exact)
    """
    grads = estimates_over_keys(estimator, loss_fn, params, batch, keys)
    return _seed_statistics(grads, exact)


def compare(
    estimators: Mapping[str, Estimator],
    loss_fn: LossFn,
    params: Any,
    batches: Any | list[Any],
    seeds: int | jax.Array = 16,
    *,
    microbatched: Collection[str] = (),
    seed: int = 0,
) -> QualityTable:
    """Compare estimators on the same model, batches and keys; exact = backprop, same batch.

    Args:
      estimators: ``{name: estimator}``.
      loss_fn: ``loss_fn(params, batch) -> scalar``; with micro-batches it is called on one
        micro-batch and must be a mean over examples (as a ``Stack`` is).
      params: where to compare.
      batches: one batch (any pytree but a list) or a list of batches; statistics are
        averaged over them (the
        cosine spread is the standard deviation over all (batch, seed) pairs).
      seeds: R (keys are split from ``jax.random.key(seed)``) or an array of R keys.
      microbatched: names of estimators (hybrids) that take the batch with its leading
        micro-batch axis N; if non-empty, every batch has that axis and the other estimators
        and the exact reference get it merged with :func:`flatten_microbatches`.
      seed: base seed when ``seeds`` is an int.

    Returns:
      a :class:`QualityTable` (``print(table)``, ``table.plot()``).

    Example:
      >>> table = compare({"bp": jg.backprop(), "fg": jg.forward()}, stack, params, batch, 32)
      >>> print(table)
    """
    unknown = sorted(set(microbatched) - set(estimators))
    if unknown:
        raise ValueError(f"microbatched: {unknown} are not estimator names {sorted(estimators)}")
    if not estimators:
        raise ValueError("estimators: give at least one {name: estimator}")
    keys = _keys(seeds, seed)
    batch_list = batches if isinstance(batches, list) else [batches]
    if not batch_list:
        raise ValueError("batches: give at least one batch")
    per_batch: list[dict[str, SeedStatistics]] = []
    for batch in batch_list:
        flat = flatten_microbatches(batch) if microbatched else batch
        _, exact = exact_gradient(loss_fn, params, flat)
        per_batch.append(
            {
                name: evaluate(
                    est, loss_fn, params, batch if name in microbatched else flat, keys, exact
                )
                for name, est in estimators.items()
            }
        )
    stats = {name: _average([b[name] for b in per_batch]) for name in estimators}
    return QualityTable(rows_from_statistics(stats, num_seeds=int(keys.shape[0])))


def _average(stats: list[SeedStatistics]) -> SeedStatistics:
    """Mean of per-batch statistics; cosine std pools within- and between-batch spread."""
    if len(stats) == 1:
        return stats[0]
    mean = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *stats)
    pooled = {
        k: jnp.sqrt(
            jnp.mean(jnp.stack([s.cosine_std[k] ** 2 + s.cosine_mean[k] ** 2 for s in stats]))
            - mean.cosine_mean[k] ** 2
        )
        for k in mean.cosine_std
    }
    return mean._replace(cosine_std=pooled)
