"""Quality metrics against float64 NumPy formulas, whole and per layer group."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.quality.groups import group_names, num_parameters
from jaxstream.quality.metrics import estimate_quality, seed_statistics

L = 3


def _stack_tree(rng: np.random.Generator, lead: tuple[int, ...] = ()) -> dict:
    return {
        "embed": {"w": rng.normal(size=lead + (5, 4)), "b": rng.normal(size=lead + (4,))},
        "blocks": {"w": rng.normal(size=lead + (L, 4, 4)), "b": rng.normal(size=lead + (L, 4))},
        "head": {"w": rng.normal(size=lead + (4, 3))},
    }


def _np_groups(tree: dict, lead: int = 0) -> dict[str, np.ndarray]:
    """Flat float64 vectors per group (with ``lead`` leading batch axes kept)."""

    def flat(leaves: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([x.reshape(x.shape[:lead] + (-1,)) for x in leaves], axis=-1)

    out = {
        "embed": flat([tree["embed"][k] for k in sorted(tree["embed"])]),
        **{
            f"block_{l}": flat(
                [tree["blocks"][k][(slice(None),) * lead + (l,)] for k in sorted(tree["blocks"])]
            )
            for l in range(L)
        },
        "head": flat(list(tree["head"].values())),
    }
    out["all"] = np.concatenate(list(out.values()), axis=-1)
    return out


def _to_jax(tree: dict) -> dict:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def test_group_names_and_sizes():
    tree = _to_jax(_stack_tree(np.random.default_rng(0)))
    assert group_names(tree) == ["embed", "block_0", "block_1", "block_2", "head", "all"]
    sizes = num_parameters(tree)
    assert sizes == {
        "embed": 24,
        "block_0": 20,
        "block_1": 20,
        "block_2": 20,
        "head": 12,
        "all": 96,
    }
    assert group_names({"a": 1, "b": 2}) == ["a", "b", "all"]
    assert group_names(jnp.ones(3)) == ["all"]


def test_estimate_quality_matches_numpy():
    rng = np.random.default_rng(1)
    g, e = _stack_tree(rng), _stack_tree(rng)
    q = estimate_quality(_to_jax(g), _to_jax(e))
    ng, ne = _np_groups(g), _np_groups(e)
    for k in ne:
        cos = ng[k] @ ne[k] / (np.linalg.norm(ng[k]) * np.linalg.norm(ne[k]))
        ratio = np.linalg.norm(ng[k]) / np.linalg.norm(ne[k])
        rel = np.linalg.norm(ng[k] - ne[k]) / np.linalg.norm(ne[k])
        np.testing.assert_allclose(float(q.cosine[k]), cos, rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(float(q.norm_ratio[k]), ratio, rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(float(q.relative_error[k]), rel, rtol=1e-5, err_msg=k)


def test_estimate_quality_identity_and_opposite():
    e = _to_jax(_stack_tree(np.random.default_rng(2)))
    q = estimate_quality(e, e)
    assert float(q.cosine["all"]) == pytest.approx(1.0, abs=1e-6)
    assert float(q.relative_error["all"]) == pytest.approx(0.0, abs=1e-6)
    q = estimate_quality(jax.tree.map(lambda x: -2.0 * x, e), e)
    assert float(q.cosine["block_1"]) == pytest.approx(-1.0, abs=1e-6)
    assert float(q.norm_ratio["head"]) == pytest.approx(2.0, rel=1e-6)
    assert float(q.relative_error["embed"]) == pytest.approx(3.0, rel=1e-6)


def test_seed_statistics_matches_numpy():
    rng = np.random.default_rng(3)
    r = 7
    e = _stack_tree(rng)
    noise = _stack_tree(rng, lead=(r,))
    g = jax.tree.map(lambda x, n: 0.8 * x + 0.5 * n, e, noise)  # biased and noisy
    stats = jax.jit(seed_statistics)(_to_jax(g), _to_jax(e))  # as compare() runs it
    ng, ne = _np_groups(g, lead=1), _np_groups(e)
    for k in ne:
        mean = ng[k].mean(axis=0)
        bias = np.linalg.norm(mean - ne[k]) / np.linalg.norm(ne[k])
        var = np.sum(np.var(ng[k], axis=0, ddof=1))
        cos = ng[k] @ ne[k] / (np.linalg.norm(ng[k], axis=1) * np.linalg.norm(ne[k]))
        rel = np.linalg.norm(ng[k] - ne[k], axis=1) / np.linalg.norm(ne[k])
        ee = ne[k] @ ne[k]
        np.testing.assert_allclose(float(stats.bias[k]), bias, rtol=1e-4, err_msg=k)
        np.testing.assert_allclose(float(stats.variance[k]), var, rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(float(stats.relative_variance[k]), var / ee, rtol=1e-5)
        np.testing.assert_allclose(float(stats.snr[k]), ee / var, rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(float(stats.cosine_mean[k]), cos.mean(), rtol=1e-5, err_msg=k)
        np.testing.assert_allclose(float(stats.cosine_std[k]), cos.std(ddof=1), rtol=1e-4)
        np.testing.assert_allclose(float(stats.relative_error_mean[k]), rel.mean(), rtol=1e-5)
        ratio = np.linalg.norm(ng[k], axis=1) / np.linalg.norm(ne[k])
        np.testing.assert_allclose(float(stats.norm_ratio_mean[k]), ratio.mean(), rtol=1e-5)


def test_seed_statistics_needs_two_seeds():
    e = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="at least 2 seeds"):
        seed_statistics({"w": jnp.ones((1, 3))}, e)


def test_seed_statistics_refuses_estimates_without_a_seed_axis():
    """A single estimate (no seed axis) or estimates of another shape broadcast against the
    exact gradient into figures of nothing: refused, naming the leaf and the shape wanted."""
    e = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(2,\); it must be "
                                         r"\(seeds, \*\(2,\)\)"):
        seed_statistics(e, e)  # one estimate: its first axis is not seeds
    with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3, 2, 2\)"):
        seed_statistics({"w": jnp.ones((3, 2, 2)), "b": jnp.ones((3, 2, 2))}, e)
    with pytest.raises(ValueError, match="different seed counts"):
        seed_statistics({"w": jnp.ones((3, 2, 2)), "b": jnp.ones((4, 2))}, e)
    with pytest.raises(ValueError, match="different trees"):
        seed_statistics({"w": jnp.ones((3, 2, 2))}, e)


def test_generic_pytree_groups():
    rng = np.random.default_rng(4)
    g = {"a": rng.normal(size=(3, 2)), "b": rng.normal(size=(4,))}
    e = {"a": rng.normal(size=(3, 2)), "b": rng.normal(size=(4,))}
    q = estimate_quality(_to_jax(g), _to_jax(e))
    for k in ("a", "b"):
        x, y = g[k].ravel(), e[k].ravel()
        np.testing.assert_allclose(
            float(q.cosine[k]), x @ y / np.linalg.norm(x) / np.linalg.norm(y), rtol=1e-5
        )
    x = np.concatenate([g["a"].ravel(), g["b"]])
    y = np.concatenate([e["a"].ravel(), e["b"]])
    np.testing.assert_allclose(
        float(q.cosine["all"]), x @ y / np.linalg.norm(x) / np.linalg.norm(y), rtol=1e-5
    )


def test_gradient_error_does_not_divide_noise_by_noise():
    """Whole-tree ‖a − b‖ / ‖b‖, and per leaf ‖a_l − b_l‖ / max(‖b_l‖, 1e-3 ‖b‖): a leaf whose
    exact gradient is 0 is measured against the whole gradient's norm, while a small but real
    leaf keeps its own scale; checked against a float64 NumPy formula written here."""
    import numpy as np

    from jaxstream.quality import gradient_error, max_rel_err

    exact = {"w": np.array([3.0, -4.0]), "key_bias": np.array([0.0, 4e-9]),
             "small": np.array([0.01, 0.02])}
    est = {"w": np.array([3.0, -4.0 + 5e-6]), "key_bias": np.array([3e-9, -2e-9]),
           "small": np.array([0.01 + 1e-8, 0.02 + 2e-8])}
    flat = lambda t: np.concatenate([t[k] for k in sorted(t)])
    whole_norm = np.linalg.norm(flat(exact))
    want_whole = np.linalg.norm(flat(est) - flat(exact)) / whole_norm
    want_leaf = {k: np.linalg.norm(est[k] - exact[k])
                 / max(np.linalg.norm(exact[k]), 1e-3 * whole_norm) for k in exact}
    e = gradient_error(est, exact)
    assert np.isclose(e.whole, want_whole, rtol=1e-12)
    assert np.isclose(e.leaf, max(want_leaf.values()), rtol=1e-12)
    assert e.worst == "['key_bias']" and e.leaf < 2e-6  # ~3.6e-9 / 5e-3
    assert np.isclose(max_rel_err(est, exact), max(want_whole, e.leaf), rtol=1e-12)
    own_scale = max(np.linalg.norm(est[k] - exact[k]) / np.linalg.norm(exact[k]) for k in exact)
    assert own_scale > 0.5  # each leaf on its own scale: noise over noise
    assert gradient_error(exact, exact) == (0.0, 0.0, "['key_bias']")


def test_gradient_error_flags_a_wrong_leaf_and_a_wrong_whole():
    """A genuinely wrong gradient is flagged: a small leaf off by 10 % (hidden in the whole
    tree's norm) by the per-leaf figure, a 1 % global error by both."""
    import numpy as np

    from jaxstream.quality import gradient_error

    exact = {"big": np.full(1000, 1.0), "small": np.array([0.05, -0.05])}
    small_off = {"big": exact["big"], "small": exact["small"] * 1.1}
    e = gradient_error(small_off, exact)
    assert e.whole < 1e-3 and np.isclose(e.leaf, 0.1) and e.worst == "['small']"
    scaled = {k: v * 1.01 for k, v in exact.items()}
    e = gradient_error(scaled, exact)
    assert np.isclose(e.whole, 0.01) and np.isclose(e.leaf, 0.01)
    with pytest.raises(ValueError, match="trees differ"):
        gradient_error({"a": exact["big"]}, exact)


def test_gradient_error_refuses_other_layouts_and_names_a_nan_leaf():
    """Trees with the same number of entries in another layout (a list against a dict, a
    transposed or reshaped leaf) are refused, not compared entry by entry; a leaf holding a
    nan is the worst one, wherever it is."""
    import numpy as np

    from jaxstream.quality import gradient_error

    a, b = np.arange(6.0).reshape(3, 2), np.ones(2)
    with pytest.raises(ValueError, match=r"trees differ.*leaves in one only"):
        gradient_error([a, b], {"a": a, "b": b})
    with pytest.raises(ValueError, match=r"leaf \['a'\]: shapes differ, \(2, 3\) vs \(3, 2\)"):
        gradient_error({"a": a.T, "b": b}, {"a": a, "b": b})
    with pytest.raises(ValueError, match=r"shapes differ, \(2, 1\) vs \(2,\)"):
        gradient_error({"a": a, "b": b[:, None]}, {"a": a, "b": b})
    off = {"a": a * 1.01, "b": np.array([1.0, np.nan])}
    e = gradient_error(off, {"a": a, "b": b})
    assert np.isnan(e.leaf) and e.worst == "['b']" and np.isnan(e.max)
