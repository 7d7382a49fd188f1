"""Reference values for forward-gradient quality: the cosine of a random-direction estimate.

For ĝ = (g·v) v with v Gaussian in n dimensions, ĝ·g = (g·v)² >= 0 and v/|v| is uniform on the
sphere, so cos(ĝ, g) = |u_1| for a uniform unit vector u, whose mean is
Γ(n/2) / (√π Γ((n+1)/2)) ≈ √(2/(πn)), and whose second moment is exactly 1/n. These are the
baselines a correction must beat.
"""

from __future__ import annotations

import math


def gaussian_cosine_mean(n: int) -> float:
    """Exact E[cos(ĝ, g)] for one Gaussian tangent in ``n`` dimensions.

    Example:
      >>> round(gaussian_cosine_mean(1000), 5)
      0.02523
    """
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    return math.exp(math.lgamma(n / 2) - math.lgamma((n + 1) / 2)) / math.sqrt(math.pi)


def gaussian_cosine_approx(n: int) -> float:
    """The large-n approximation √(2/(πn)) of :func:`gaussian_cosine_mean`."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    return math.sqrt(2.0 / (math.pi * n))


def gaussian_cosine_std(n: int) -> float:
    """Standard deviation of cos(ĝ, g) for one Gaussian tangent (E[cos²] = 1/n exactly)."""
    m = gaussian_cosine_mean(n)
    return math.sqrt(max(1.0 / n - m * m, 0.0))
