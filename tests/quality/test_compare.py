"""compare(): exact estimators score perfectly, tables print/save/plot, hybrid ingredients."""

import json

import jax
import jax.numpy as jnp
import matplotlib.figure
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.quality import (
    ExactSubset,
    MicrobatchForward,
    compare,
    estimates_over_keys,
    exact_gradient,
    flatten_microbatches,
)
from jaxstream.quality.compare import QUICK_COMPILE

N, B = 4, 6


@pytest.fixture(scope="module")
def problem():
    stack = mlp(in_dim=8, width=8, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    kx, ky = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(kx, (N, B, 8)), "y": jax.random.randint(ky, (N, B), 0, 3)}
    return stack, params, batch


def test_compare_table(problem, tmp_path):
    stack, params, batch = problem
    table = compare(
        {
            "backprop": jg.backprop(),
            "forward": jg.forward(num_tangents=2),
            "all exact": jg.hybrid(num_exact=N, correction="replace"),
        },
        stack,
        params,
        batch,
        seeds=4,
        microbatched={"all exact"},
    )
    for name in ("backprop", "all exact"):  # exact estimators: perfect scores, no variance
        row = table.row(name)
        assert row["cosine_mean"] == pytest.approx(1.0, abs=1e-5)
        assert row["relative_error_mean"] < 1e-4 and row["relative_variance"] < 1e-8
        assert table.row(name, "block_1")["cosine_mean"] == pytest.approx(1.0, abs=1e-5)
    assert 0 < table.row("forward")["cosine_mean"] < 0.9
    assert table.groups == ["embed", "block_0", "block_1", "head", "all"]
    text = str(table)
    assert "forward" in text and "cosine" in text
    assert "block_0" in table.format(groups=None)
    assert isinstance(table.plot(), matplotlib.figure.Figure)
    rows = json.loads(table.save(tmp_path / "t.json").read_text())
    assert len(rows) == 3 * 5
    assert "cosine_mean" in table.save(tmp_path / "t.csv").read_text().splitlines()[0]
    with pytest.raises(ValueError, match="suffix"):
        table.save(tmp_path / "t.txt")


def test_compare_bad_input(problem):
    stack, params, batch = problem
    with pytest.raises(ValueError, match="microbatched"):
        compare({"a": jg.backprop()}, stack, params, batch, microbatched={"b"})
    with pytest.raises(ValueError, match="seeds"):
        compare({"a": jg.backprop()}, stack, params, batch, seeds=1)
    with pytest.raises(TypeError, match="seeds: an int R >= 2 or an array of R keys, got 2.5"):
        compare({"a": jg.backprop()}, stack, params, batch, seeds=2.5)
    flat = jax.tree.map(lambda a: a.reshape((N * B,) + a.shape[2:]), batch)
    with pytest.raises(ValueError, match=r"microbatched: .* leaf \['y'\] has shape \(24,\)"):
        compare({"h": jg.hybrid(num_exact=2)}, stack, params, flat, microbatched={"h"})


def test_ingredients_match_definitions(problem):
    stack, params, batch = problem
    run = lambda est, b, k, **kw: jax.jit(
        lambda p, b, k: est(stack, p, b, k, **kw), compiler_options=QUICK_COMPILE
    )(params, b, k)
    close = lambda a, b, rtol=1e-4: jax.tree.map(
        lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-6), a, b
    )
    flat = flatten_microbatches(batch)
    _, exact = exact_gradient(stack, params, flat)
    # gradient of the merged batch == mean of the micro-batch gradients
    per_mb = jax.jit(jax.vmap(lambda b: jax.grad(stack)(params, b)), compiler_options=QUICK_COMPILE)(
        batch
    )
    close(exact, jax.tree.map(lambda g: g.mean(0), per_mb))
    key = jax.random.key(5)
    # the exact subset with every micro-batch is the exact gradient
    close(exact, run(ExactSubset(indices=tuple(range(N))), batch, key)[1])
    # random subset: the one the hybrid draws for the same key (hybrid diagnostics)
    _, _, diag = run(jg.hybrid(num_exact=2), batch, key, diagnostics=True)
    idx = tuple(int(i) for i in diag["exact_indices"])
    h_rand = run(ExactSubset(num_exact=2), batch, key)[1]
    close(h_rand, run(ExactSubset(indices=idx), batch, key)[1], rtol=1e-6)
    # MicrobatchForward is the mean of per-micro-batch forward estimates keyed fold_in(key, n)
    fwd = jg.forward()
    g = run(MicrobatchForward(fwd), batch, key)[1]
    per = jax.vmap(lambda b, n: fwd(stack, params, b, jax.random.fold_in(key, n))[1])
    parts = jax.jit(per, compiler_options=QUICK_COMPILE)(batch, jnp.arange(N))
    close(g, jax.tree.map(lambda x: x.mean(0), parts))


def test_control_variate_lowers_variance_on_correlated_microbatches():
    """Micro-batches that share their inputs up to small noise have alike gradients, so the
    control variate's residual (g_n - h) is small and its variance well below plain forward's."""
    stack = mlp(in_dim=8, width=8, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    kx, kn = jax.random.split(jax.random.key(3))
    base = jax.random.normal(kx, (B, 8))
    x = base[None] + 0.05 * jax.random.normal(kn, (N, B, 8))
    batch = {"x": x, "y": jnp.tile(jnp.arange(B) % 3, (N, 1))}
    _, exact = exact_gradient(stack, params, flatten_microbatches(batch))
    keys = jax.random.split(jax.random.key(4), 256)

    def sq_errors(est):
        grads = estimates_over_keys(est, stack, params, batch, keys)
        return np.asarray(
            jax.jit(
                jax.vmap(
                    lambda g: sum(
                        jnp.sum((a - b) ** 2)
                        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(exact))
                    )
                )
            )(grads)
        )

    fwd = sq_errors(MicrobatchForward(jg.forward()))
    cv = sq_errors(jg.hybrid(num_exact=2, correction="control_variate"))
    # both are unbiased, so the mean squared error estimates the total variance
    se = np.hypot(fwd.std(ddof=1), cv.std(ddof=1)) / np.sqrt(len(keys))
    assert fwd.mean() - cv.mean() > 4 * se, (fwd.mean(), cv.mean(), se)
    assert cv.mean() < 0.1 * fwd.mean()
