"""Single-tangent Gaussian forward gradient: mean cosine to the exact gradient vs theory."""

import jax
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.quality import (
    estimate_quality,
    estimates_over_keys,
    exact_gradient,
    gaussian_cosine_approx,
    gaussian_cosine_mean,
    num_parameters,
)

NUM_SEEDS = 2048


@pytest.mark.parametrize("layered", [True, False], ids=["stack", "generic"])
def test_gaussian_single_tangent_cosine_matches_theory(layered):
    stack = mlp(in_dim=8, width=12, depth=2, num_classes=4)
    params = stack.init(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(kx, (16, 8)), "y": jax.random.randint(ky, (16,), 0, 4)}
    # A plain function is treated as a generic pytree loss (tangents per leaf, materialised).
    loss_fn = stack if layered else (lambda p, b: stack(p, b))
    _, exact = exact_gradient(stack, params, batch)
    keys = jax.random.split(jax.random.key(2), NUM_SEEDS)
    grads = estimates_over_keys(jg.forward(1, "gaussian"), loss_fn, params, batch, keys)
    cos = np.asarray(jax.jit(jax.vmap(lambda g: estimate_quality(g, exact).cosine["all"]))(grads))
    n = num_parameters(params)["all"]
    assert np.all(cos >= -1e-5)  # (g.v)^2 >= 0: a single-tangent estimate never points away
    mean, se = cos.mean(), cos.std(ddof=1) / np.sqrt(NUM_SEEDS)
    assert abs(mean - gaussian_cosine_mean(n)) <= 4 * se, (mean, gaussian_cosine_mean(n), se)
    approx = gaussian_cosine_approx(n)
    assert abs(mean - approx) / approx < 0.10, (mean, approx)
    # E[cos^2] = 1/n exactly; its sample mean has its own standard error
    sq = cos**2
    assert abs(sq.mean() - 1.0 / n) <= 4 * sq.std(ddof=1) / np.sqrt(NUM_SEEDS)


def test_theory_formulas():
    from jaxstream.quality import gaussian_cosine_std

    assert gaussian_cosine_mean(1) == pytest.approx(1.0)
    assert gaussian_cosine_mean(2) == pytest.approx(2 / np.pi)  # E|cos(theta)|, theta uniform
    rng = np.random.default_rng(0)
    v = rng.normal(size=(200_000, 5))
    c = np.abs(v[:, 0]) / np.linalg.norm(v, axis=1)
    assert gaussian_cosine_mean(5) == pytest.approx(c.mean(), abs=4 * c.std() / np.sqrt(len(c)))
    assert gaussian_cosine_std(5) == pytest.approx(c.std(), rel=0.01)
    assert gaussian_cosine_mean(10_000) == pytest.approx(gaussian_cosine_approx(10_000), rel=1e-4)
    with pytest.raises(ValueError, match="n: must be >= 1"):
        gaussian_cosine_mean(0)
