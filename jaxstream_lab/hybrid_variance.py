"""A variance model of the hybrid corrections: E‖ĝ − g‖² of each, from per-micro-batch gradients.

g = (1/N) Σ_n g_n is the full batch's gradient (N equal micro-batches), h = mean_{s∈S} g_s the
exact-subset mean over S micro-batches drawn uniformly without replacement, and each forward
estimate f_n of a vector a is unbiased with noise E‖f_n − a‖² = ν‖a‖², independent across
micro-batches and of the selection. For K weight tangents with iid entries (E v = 0,
E v vᵀ = I, fourth moment μ₄) ν = κ / K with κ = P + μ₄ − 2: P − 1 for Rademacher (the
library's default), P + 1 for Gaussian. ν is the forward part's correlation in disguise:
ρ² = E[f·a]² / (E‖f‖² ‖a‖²) = 1 / (1 + ν), so ν = 1/ρ² − 1.

With σ² = Σ_n ‖g_n − g‖² / (N − 1) (the micro-batch gradients' spread), m₂ = mean_n ‖g_n‖²
and A = σ² (1/S − 1/N) (the exact subset's error), every estimator of
:mod:`jaxstream.grad` that is linear in its tangent part has an exact MSE
(docs/hybrid_variance.md derives each line):

* exact subset: A (bias given S: h − g);
* forward on the whole batch (K tangents): ν ‖g‖²;
* forward per micro-batch (K tangents each, averaged): ν m₂ / N;
* replace: ν (N − S) m₂ / N² (unbiased given S);
* control variate: B = ν (N − S) σ² (1 + 1/S) / N² (unbiased given S);
* weighted, a fixed β: (1 − β)² A + β² B (bias given S: (1 − β)(h − g)).

``guess`` (the projection of g on u = h/‖h‖) is deterministic given S: its MSE is the exact
mean over the C(N, S) selections of ‖g‖² − (g·u)², from the per-micro-batch gradients
(:func:`guess_mse`). ``stein`` (β = max(0, 1 − b/‖r‖²) per segment, a ratio of random
quadratic forms) has no closed form; :func:`stein_mse` is a large-P model of it (Gaussian
scalars, Gauss–Hermite quadrature, a fixed-seed average over the directional derivatives).

Cost (:class:`Costs`) is in the lab's unit, forward passes of the whole batch: a forward part
with K tangents on every micro-batch costs ``forward(K)`` (independent of N: the jvps see every
example once), the exact gradient of S of N micro-batches ``exact · S / N``.

Example:
  >>> m = moments(per_micro_batch_grads)          # (N, P) array
  >>> control_variate(m, s=2, nu=noise_ratio(m.size, k=1))
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

MAX_SUBSETS = 5000  # selections enumerated exactly; more are sampled (fixed seed)


class Moments(NamedTuple):
    """What the model needs of the N per-micro-batch gradients.

    Attributes:
      num: N, micro-batches.
      size: P, parameters.
      spread: σ² = Σ_n ‖g_n − g‖² / (N − 1).
      second: m₂ = mean_n ‖g_n‖².
      full: ‖g‖², the full batch's gradient.
    """

    num: int
    size: int
    spread: float
    second: float
    full: float


def moments(grads: np.ndarray) -> Moments:
    """:class:`Moments` of per-micro-batch gradients ``grads`` (N, P), in float64."""
    g = np.asarray(grads, np.float64)
    if g.ndim != 2 or g.shape[0] < 2:
        raise ValueError(f"grads: expected (N >= 2, P) per-micro-batch gradients, got {g.shape}")
    mean = g.mean(0)
    n = g.shape[0]
    return Moments(n, g.shape[1], float(((g - mean) ** 2).sum() / (n - 1)),
                   float((g ** 2).sum(1).mean()), float((mean ** 2).sum()))


def kappa(size: int, distribution: str = "rademacher") -> float:
    """κ = E‖(a·v)v − a‖² / ‖a‖² for one tangent of iid entries: P − 1 (Rademacher), P + 1
    (Gaussian)."""
    fourth = {"rademacher": 1.0, "gaussian": 3.0}
    if distribution not in fourth:
        raise ValueError(f"distribution: {distribution!r}; allowed: {tuple(fourth)}")
    return size + fourth[distribution] - 2.0


def noise_ratio(size: int, k: int, distribution: str = "rademacher") -> float:
    """ν = κ / K of a K-tangent forward estimate (mean of K one-tangent estimates)."""
    return kappa(size, distribution) / k


def rho(nu: float) -> float:
    """The forward estimate's correlation with what it estimates, ρ = 1/√(1 + ν)."""
    return 1.0 / math.sqrt(1.0 + nu)


def nu_of_rho(r: float) -> float:
    """ν = 1/ρ² − 1: the noise ratio of an unbiased forward part with correlation ρ."""
    if not 0.0 < r <= 1.0:
        raise ValueError(f"rho: {r} must be in (0, 1]")
    return 1.0 / (r * r) - 1.0


def _check(m: Moments, s: float) -> None:
    if not 0 < s <= m.num:
        raise ValueError(f"num_exact: {s} must be in (0, N={m.num}]")


def exact_subset(m: Moments, s: float) -> float:
    """A = σ² (1/S − 1/N): S of N micro-batches without replacement (S may be fractional, the
    interpolation at equal compute)."""
    _check(m, s)
    return m.spread * (1.0 / s - 1.0 / m.num)


def forward_batch(m: Moments, nu: float) -> float:
    """ν ‖g‖²: one forward estimate of the whole batch's gradient (``jg.forward``)."""
    return nu * m.full


def forward_micro(m: Moments, nu: float) -> float:
    """ν m₂ / N: a forward estimate per micro-batch, averaged (the hybrid's forward part)."""
    return nu * m.second / m.num


def replace(m: Moments, s: int, nu: float) -> float:
    """ν (N − S) m₂ / N²: each micro-batch is outside S with probability (N − S)/N."""
    _check(m, s)
    return nu * (m.num - s) * m.second / m.num ** 2


def control_variate(m: Moments, s: int, nu: float) -> float:
    """B = ν (N − S) σ² (1 + 1/S) / N²: E Σ_{n∉S} ‖g_n − h‖² = (N − S) σ² (1 + 1/S)."""
    _check(m, s)
    return nu * (m.num - s) * m.spread * (1.0 + 1.0 / s) / m.num ** 2


def weighted(m: Moments, s: int, nu: float, beta: float) -> float:
    """(1 − β)² A + β² B: ĝ − g = (1 − β)(h − g) + β ε, ε the tangent noise (mean zero given
    S, so the cross term vanishes)."""
    return (1.0 - beta) ** 2 * exact_subset(m, s) + beta ** 2 * control_variate(m, s, nu)


def weighted_beta(n: int, s: int, k: int, size: int) -> float:
    """The library's fixed β (:func:`jaxstream.grad.corrections.shrinkage`, one segment group of
    S): a'/(a' + b'), a' = S/(S + 1) (1/S − 1/N) / P, b' = (N − S)/(N² K); = A/(A + B) with κ
    taken as P."""
    a = s / (s + 1.0) * (1.0 / s - 1.0 / n) / size
    b = (n - s) / (n * n * k)
    return a / (a + b) if a + b > 0 else 0.0


def best_weighted(m: Moments, s: int, nu: float) -> float:
    """min over a fixed β of (1 − β)² A + β² B: A B / (A + B), at β = A / (A + B). No estimator
    h + β r with a fixed β does better; A/(A + B) − 1 = −B/(A+B) is its gain over the subset."""
    a, b = exact_subset(m, s), control_variate(m, s, nu)
    return a * b / (a + b) if a + b > 0 else 0.0


def selections(n: int, s: int, seed: int = 0, limit: int = MAX_SUBSETS) -> list[tuple[int, ...]]:
    """Every S-subset of N (``limit`` of them sampled, fixed seed, where there are more)."""
    if math.comb(n, s) <= limit:
        return list(itertools.combinations(range(n), s))
    rng = np.random.default_rng(seed)
    return [tuple(sorted(rng.choice(n, s, replace=False))) for _ in range(limit)]


def guess_mse(grads: np.ndarray, s: int, limit: int = MAX_SUBSETS) -> float:
    """``guess``: ĝ = (g·u) u with u = h/‖h‖ (one jvp along u per micro-batch): error
    ‖g‖² − (g·u)², averaged exactly over the selections. Never above the exact subset's
    ‖g − h‖² (the closest point to g on the line through h), biased. Exact up to ``limit``
    selections, sampled beyond."""
    g = np.asarray(grads, np.float64)
    full = g.mean(0)
    out = []
    for sel in selections(g.shape[0], s, limit=limit):
        h = g[list(sel)].mean(0)
        hh = float(h @ h)
        out.append(float(full @ full) - (float(full @ h) ** 2 / hh if hh > 0 else 0.0))
    return float(np.mean(out))


def stein_mse(grads: np.ndarray, segments: np.ndarray, s: int, k: int, draws: int = 2000,
              nodes: int = 48, seed: int = 0) -> tuple[float, float]:
    """Large-P model of ``stein`` (Rademacher tangents): ``(MSE, its Monte-Carlo standard
    error)``.

    Per selection S and segment σ, with a_j = g_n − h (K copies per n ∉ S, M = (N − S) K of
    them), c_j = a_j·v_j the residual scalars, r_σ = (1/(NK)) Σ_j c_j v_j,σ and
    b_σ = P_σ Σ_j c_j² / (NK)²: for ±1 tangents ‖r_σ‖² = b_σ + X_σ exactly, with
    X_σ = (1/(NK)²) Σ_{j≠l} c_j c_l v_j,σ·v_l,σ, so β_σ = max(0, X_σ / (b_σ + X_σ)) and the
    error is ‖D_σ‖² + 2 β_σ D_σ·r_σ + X_σ⁺² / (b_σ + X_σ), D = h − g. Model: c_j ~ N(0,
    ‖a_j‖²) (drawn, fixed seed); given c, X_σ Gaussian with mean Σ_{j≠l} c_j² c_l²
    (a_j,σ·a_l,σ) / (‖a_j‖² ‖a_l‖² (NK)²) and variance 2 P_σ Σ_{j≠l} c_j² c_l² / (NK)⁴
    (v_j·v_l ≈ N(0, P_σ)), integrated by Gauss–Hermite quadrature; E[D_σ·r_σ | c] =
    Σ_j c_j² (D_σ·a_j,σ) / (‖a_j‖² NK). ``segments``: (P,) segment id of each coordinate.
    """
    g = np.asarray(grads, np.float64)
    seg = np.asarray(segments)
    n = g.shape[0]
    nk = n * k
    full = g.mean(0)
    xs, wq = np.polynomial.hermite_e.hermegauss(nodes)
    wq = wq / wq.sum()
    rng = np.random.default_rng(seed)
    subsets = selections(n, s, seed)
    per_draw = np.zeros(draws)
    for sel in subsets:
        h = g[list(sel)].mean(0)
        d = h - full
        a = np.repeat(g[[i for i in range(n) if i not in sel]] - h, k, axis=0)
        an2 = np.maximum((a ** 2).sum(1), 1e-300)
        c2 = (rng.standard_normal((draws, a.shape[0])) ** 2) * an2
        off = c2.sum(1) ** 2 - (c2 ** 2).sum(1)
        for sid in np.unique(seg):
            mask = seg == sid
            a_s, d_s = a[:, mask], d[mask]
            gram = a_s @ a_s.T / np.outer(an2, an2)
            np.fill_diagonal(gram, 0.0)
            b = mask.sum() * c2.sum(1) / nk ** 2
            mu = np.einsum("dj,jl,dl->d", c2, gram, c2) / nk ** 2
            tau = np.sqrt(2.0 * mask.sum() * off) / nk ** 2
            x = mu[:, None] + tau[:, None] * xs[None, :]
            pos = np.maximum(x, 0.0)
            denom = np.maximum(b[:, None] + x, 1e-300)
            beta = (pos / denom * wq).sum(1)
            sq = (pos ** 2 / denom * wq).sum(1)
            dr = (c2 * ((a_s @ d_s) / an2)).sum(1) / nk
            per_draw += (float(d_s @ d_s) + 2.0 * beta * dr + sq) / len(subsets)
    return float(per_draw.mean()), float(per_draw.std(ddof=1) / math.sqrt(draws))


def segment_ids(params: dict) -> np.ndarray:
    """The segment of each coordinate of a stack's params, in ``ravel_pytree`` order: 0 the
    embed, 1..L the blocks, L + 1 the head (the segments ``stein`` takes its β over)."""
    import jax
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    layers = jax.tree.leaves(params["blocks"])[0].shape[0]
    ids = {"embed": jax.tree.map(lambda x: jnp.zeros(x.shape), params["embed"]),
           "blocks": jax.tree.map(lambda x: jnp.broadcast_to(
               1.0 + jnp.arange(layers, dtype=jnp.float32).reshape((-1,) + (1,) * (x.ndim - 1)),
               x.shape), params["blocks"]),
           "head": jax.tree.map(lambda x: jnp.full(x.shape, layers + 1.0), params["head"])}
    return np.asarray(ravel_pytree(ids)[0]).astype(int)


class Costs(NamedTuple):
    """A step's cost in forward passes of the whole batch (the lab's unit, from matmul FLOPs).

    Attributes:
      forward_base, forward_per_tangent: a forward part with K tangents on every micro-batch
        costs ``forward_base + forward_per_tangent · K`` (one primal, K tangent products).
      exact: the rematerialised exact gradient of every micro-batch (the exact part of S of N
        costs ``exact · S / N``); backprop of the whole batch costs ``backprop``.
      backprop: one plain backprop of the whole batch.
    """

    forward_base: float = 1.0
    forward_per_tangent: float = 2.0
    exact: float = 4.0
    backprop: float = 3.0

    def forward(self, k: float) -> float:
        """A forward part with K tangents on every micro-batch."""
        return self.forward_base + self.forward_per_tangent * k

    def exact_part(self, s: float, n: int) -> float:
        """The exact gradients of S of N micro-batches."""
        return self.exact * s / n

    def hybrid(self, s: float, n: int, k: float) -> float:
        """Forward part on all N plus the exact part on S."""
        return self.forward(k) + self.exact_part(s, n)

    def subset_at(self, cost: float, n: int) -> float:
        """S' (fractional, at most N) an exact subset buys with ``cost``."""
        return min(float(n), cost * n / self.exact)

    def tangents_at(self, cost: float) -> float:
        """K' (fractional) a forward-only estimator buys with ``cost``."""
        return (cost - self.forward_base) / self.forward_per_tangent


def critical_nu(m: Moments, s: int, costs: Costs, forward_cost: float) -> float:
    """The largest noise ratio ν at which the best fixed-β hybrid (A B/(A + B)) still beats the
    exact subset bought with the same compute (S' = S + N · forward_cost / exact); 0 where S'
    reaches N (then that subset is the whole batch: error 0, no hybrid wins). A B/(A + B) < A'
    ⇔ B < A A' / (A − A')."""
    n = m.num
    s_eq = costs.subset_at(costs.exact_part(s, n) + forward_cost, n)
    a, a_eq = exact_subset(m, s), exact_subset(m, s_eq)
    if a_eq <= 0.0 or a_eq >= a:
        return 0.0 if a_eq <= 0.0 else math.inf
    b_bound = a * a_eq / (a - a_eq)
    per_nu = control_variate(m, s, 1.0)
    return b_bound / per_nu if per_nu > 0 else math.inf
