"""Quality of gradient estimates against the exact gradient, whole and per layer group.

One estimate ``g`` against the exact gradient ``e`` of the same batch:

* cosine similarity ``<g, e> / (|g| |e|)``;
* norm ratio ``|g| / |e|``;
* relative error ``|g - e| / |e|``.

R estimates ``g_1 ... g_R`` (one per PRNG key, same batch) with mean ``m``:

* bias ``|m - e| / |e|`` (relative; for an unbiased estimator it shrinks like ``1/sqrt(R)``);
* variance ``sum_i var_r(g_ri)`` (total over coordinates, sample variance with ``ddof=1``) and
  relative variance ``variance / |e|^2``;
* signal-to-noise ratio ``|e|^2 / variance``, the signal being the known exact gradient;
* mean and standard deviation (``ddof=1``) over seeds of the cosine, norm ratio and relative
  error.

All values are ``{group: scalar}`` dicts with the groups of :mod:`jaxstream.quality.groups`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxstream.quality.groups import accumulate, group_sums

Groups = dict[str, jax.Array]

_TINY = 1e-30


class EstimateQuality(NamedTuple):
    """Quality of one estimate; each field is ``{group: value}``."""

    cosine: Groups
    norm_ratio: Groups
    relative_error: Groups


class SeedStatistics(NamedTuple):
    """Statistics over R estimates of the same gradient; each field is ``{group: value}``."""

    bias: Groups
    variance: Groups
    relative_variance: Groups
    snr: Groups
    cosine_mean: Groups
    cosine_std: Groups
    norm_ratio_mean: Groups
    relative_error_mean: Groups


def _safe_sqrt(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.maximum(x, 0.0))


def estimate_quality(estimate: Any, exact: Any) -> EstimateQuality:
    """Cosine, norm ratio and relative error of one estimate, whole and per group.

    Args:
      estimate: a gradient estimate (pytree).
      exact: the exact gradient, same structure.

    Returns:
      :class:`EstimateQuality`.

    Example:
      >>> q = estimate_quality(g_hat, g_exact)
      >>> float(q.cosine["all"])
    """
    gg = group_sums(lambda g: g * g, estimate)
    ee = group_sums(lambda e: e * e, exact)
    ge = group_sums(lambda g, e: g * e, estimate, exact)
    dd = group_sums(lambda g, e: (g - e) ** 2, estimate, exact)
    cosine = {k: ge[k] / jnp.maximum(_safe_sqrt(gg[k] * ee[k]), _TINY) for k in ee}
    norm_ratio = {k: _safe_sqrt(gg[k] / jnp.maximum(ee[k], _TINY)) for k in ee}
    rel_err = {k: _safe_sqrt(dd[k] / jnp.maximum(ee[k], _TINY)) for k in ee}
    return EstimateQuality(cosine, norm_ratio, rel_err)


def cosine_similarity(estimate: Any, exact: Any) -> jax.Array:
    """Cosine similarity of two whole pytrees (a scalar).

    Example:
      >>> cosine_similarity({"w": jnp.ones(2)}, {"w": jnp.array([1.0, 0.0])})  # 0.7071
    """
    return estimate_quality(estimate, exact).cosine["all"]


def check_seed_axis(estimates: Any, exact: Any, who: str) -> None:
    """``estimates`` is ``exact``'s tree with one leading (seed) axis on every leaf, the same
    length on all: a single estimate, or one against another tree, would broadcast into
    figures of nothing."""
    ke = jax.tree_util.tree_flatten_with_path(estimates)[0]
    kx = jax.tree_util.tree_flatten_with_path(exact)[0]
    if [p for p, _ in ke] != [p for p, _ in kx]:
        raise ValueError(f"{who}: estimates and exact are different trees ({len(ke)} vs "
                         f"{len(kx)} leaves, or other paths)")
    seeds = set()
    for (path, e), (_, x) in zip(ke, kx):
        if tuple(jnp.shape(e))[1:] != tuple(jnp.shape(x)):
            raise ValueError(f"{who}: estimates leaf {jax.tree_util.keystr(path)} has shape "
                             f"{tuple(jnp.shape(e))}; it must be (seeds, *{tuple(jnp.shape(x))}): "
                             "the exact gradient's shape with a leading seed axis")
        seeds.add(jnp.shape(e)[0])
    if len(seeds) > 1:
        raise ValueError(f"{who}: the estimates' leaves have different seed counts "
                         f"{sorted(seeds)} on their leading axis")


def seed_statistics(estimates: Any, exact: Any) -> SeedStatistics:
    """Bias, variance, SNR and mean cosine of R stacked estimates, whole and per group.

    Args:
      estimates: pytree whose leaves carry a leading seed axis R >= 2 (e.g. the output of
        ``jax.vmap(estimator, in_axes=(None, None, 0))`` over R keys).
      exact: the exact gradient (no seed axis).

    Returns:
      :class:`SeedStatistics`.

    Example:
      >>> keys = jax.random.split(jax.random.key(0), 64)
      >>> grads = jax.vmap(lambda k: est(loss_fn, params, batch, k)[1])(keys)
      >>> float(seed_statistics(grads, exact).snr["all"])
    """
    check_seed_axis(estimates, exact, "seed_statistics")
    num_seeds = jax.tree.leaves(estimates)[0].shape[0]
    if num_seeds < 2:
        raise ValueError(
            f"seed_statistics: need at least 2 seeds on the leading axis, got {num_seeds}"
        )
    per_seed = jax.vmap(estimate_quality, in_axes=(0, None))(estimates, exact)
    mean = jax.tree.map(lambda x: jnp.mean(accumulate(x), axis=0), estimates)
    ee = group_sums(lambda e: e * e, exact)
    bias_sq = group_sums(lambda m, e: (m - e) ** 2, mean, exact)
    # total sample variance: sum over seeds and coordinates of squared deviations / (R - 1);
    # the seed axis is summed first so that the groups see params-shaped leaves.
    sq_dev = jax.tree.map(
        lambda x, m: jnp.sum((accumulate(x) - m) ** 2, axis=0), estimates, mean
    )
    var_sum = group_sums(lambda s: s, sq_dev)
    variance = {k: v / (num_seeds - 1) for k, v in var_sum.items()}

    def std(x: jax.Array) -> jax.Array:
        return jnp.std(x, axis=0, ddof=1)

    return SeedStatistics(
        bias={k: _safe_sqrt(bias_sq[k] / jnp.maximum(ee[k], _TINY)) for k in ee},
        variance=variance,
        relative_variance={k: variance[k] / jnp.maximum(ee[k], _TINY) for k in ee},
        snr={k: ee[k] / jnp.maximum(variance[k], _TINY) for k in ee},
        cosine_mean={k: jnp.mean(v, axis=0) for k, v in per_seed.cosine.items()},
        cosine_std={k: std(v) for k, v in per_seed.cosine.items()},
        norm_ratio_mean={k: jnp.mean(v, axis=0) for k, v in per_seed.norm_ratio.items()},
        relative_error_mean={k: jnp.mean(v, axis=0) for k, v in per_seed.relative_error.items()},
    )


#: A leaf's error is measured against at least this share of the whole gradient's norm.
LEAF_FLOOR = 1e-3


class GradientError(NamedTuple):
    """Tree ``a`` against reference ``b`` (float64, Euclidean norms over all entries).

    Attributes:
      whole: ‖a − b‖ / ‖b‖ over the whole tree.
      leaf: max over leaves of ‖a_l − b_l‖ / max(‖b_l‖, floor · ‖b‖): each leaf against its own
        scale, so a small leaf's error is not hidden by a large one, but never against less than
        ``floor`` of the whole gradient's norm, so a leaf whose exact gradient is 0 (an
        attention key bias: float noise only) does not divide noise by noise.
      worst: the path of the leaf that gives ``leaf``.
    """

    whole: float
    leaf: float
    worst: str

    @property
    def max(self) -> float:
        """The larger of the two: the one number a test or a benchmark bounds."""
        return max(self.whole, self.leaf) if self.whole == self.whole else self.whole  # nan


def gradient_error(a: Any, b: Any, floor: float = LEAF_FLOOR) -> GradientError:
    """The comparison of gradient trees used by the tests, benchmarks and docs.

    Example:
      >>> e = gradient_error(engine_grads, in_memory_grads)
      >>> e.whole <= 1e-5 and e.leaf <= 1e-5
    """
    import numpy as np

    pa, pb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    keys_a = [jax.tree_util.keystr(p) for p, _ in pa]
    keys_b = [jax.tree_util.keystr(p) for p, _ in pb]
    if keys_a != keys_b:  # the same leaves in another layout would be compared entry by entry
        only = sorted(set(keys_a) ^ set(keys_b))[:4]
        raise ValueError(f"trees differ: {len(pa)} vs {len(pb)} leaves"
                         + (f", leaves in one only: {', '.join(only)}" if only else
                            ", the same paths in another order"))
    for key, (_, x), (_, y) in zip(keys_b, pa, pb):
        if np.shape(x) != np.shape(y):
            raise ValueError(f"leaf {key}: shapes differ, {np.shape(x)} vs {np.shape(y)}")
    va = [np.asarray(x, np.float64).ravel() for _, x in pa]
    vb = [np.asarray(x, np.float64).ravel() for _, x in pb]
    diff = [float(np.sum((u - v) ** 2)) for u, v in zip(va, vb)]
    norm = [float(np.sum(v ** 2)) for v in vb]
    whole_norm = np.sqrt(sum(norm))
    whole = float(np.sqrt(sum(diff)) / max(whole_norm, 1e-300)) if any(diff) else 0.0
    errs = [float(np.sqrt(d) / max(np.sqrt(n), floor * whole_norm, 1e-300)) if d else 0.0
            for d, n in zip(diff, norm)]
    if not errs:
        return GradientError(whole, 0.0, "")
    nan = [i for i, e in enumerate(errs) if np.isnan(e)]
    i = nan[0] if nan else int(np.argmax(errs))  # a nan leaf is the worst one
    return GradientError(whole, errs[i], keys_b[i])


def max_rel_err(a: Any, b: Any, floor: float = LEAF_FLOOR) -> float:
    """:func:`gradient_error`'s larger figure (whole tree or worst leaf, floored at ``floor`` of
    the whole gradient's norm): the one number the tests and benchmarks bound.

    Example:
      >>> max_rel_err(engine_grads, in_memory_grads) <= 1e-5
    """
    return gradient_error(a, b, floor).max
