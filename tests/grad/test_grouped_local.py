"""Grouped local losses (Ren et al.'s M/1/G): each group of a segment's output features has a
linear head and a loss of its own, and the tangent of a group reaches only its own loss.

The reference is written here from the definition, not from the library's helpers: the local
objective J = Σ_segments mean_{b, g} CE(W_g h_g + c_g, y) with every segment's input held fixed
(+ the final head's global loss); LG-FG-A with groups is unbiased for ∇J, and its local heads
get ∇J exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad import segments as sg
from jaxstream.models import mlp, with_local_heads

G = 4


def _problem(groups: int = G):
    stack = mlp(12, 8, 2, 3)
    x = jax.random.normal(jax.random.key(1), (16, 12))
    y = jax.random.randint(jax.random.key(2), (16,), 0, 3)
    grouped = with_local_heads(stack, groups=groups, x=x)
    return stack, grouped, grouped.init(jax.random.key(0)), {"x": x, "y": y}


def _ce(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def _local_objective(stack, grouped, p, batch):
    """J written out: per segment, G linear heads on the G feature groups, mean CE."""
    y = batch["y"]

    def local(own, h):
        hg = h.reshape(h.shape[0], G, -1)
        return jnp.mean(jnp.stack([_ce(hg[:, g] @ own["kernel"][g] + own["bias"][g], y)
                                   for g in range(G)]))

    h = grouped.embed(p["embed"], batch["x"])
    total = local(p["embed"]["local_head"], h)
    for l in range(stack.num_layers):
        one = jax.tree.map(lambda a: a[l], p["blocks"])
        h = grouped.block(one, jax.lax.stop_gradient(h))
        total += local(one["local_head"], h)
    return total + jnp.mean(_ce(stack.head(p["head"], jax.lax.stop_gradient(h)), y))


def test_grouped_lg_fg_a_is_unbiased_for_the_grouped_local_objective():
    """The mean of R single-tangent estimates lies within 5 standard errors (from the sample
    variance) of ∇J on every coordinate; the local heads' part is ∇J exactly (every key)."""
    stack, grouped, p, batch = _problem()
    est = jg.forward(perturb="activations", local_losses=True, num_tangents=1)
    want = jax.grad(lambda q: _local_objective(stack, grouped, q, batch))(p)
    r = 4000
    keys = jax.random.split(jax.random.key(7), r)
    draws = jax.jit(jax.vmap(lambda k: est(grouped, p, batch, k)[1]))(keys)
    for path, got in jax.tree_util.tree_leaves_with_path(draws):
        ref = np.asarray(_at(want, path), np.float64)
        got = np.asarray(got, np.float64)
        name = jax.tree_util.keystr(path)
        if "local_head" in name:
            np.testing.assert_allclose(got, np.broadcast_to(ref, got.shape), rtol=1e-5,
                                       atol=1e-7, err_msg=name)
            continue
        mean, se = got.mean(0), got.std(0, ddof=1) / np.sqrt(r)
        assert np.all(np.abs(mean - ref) <= 5 * se + 1e-7), (name, np.max(np.abs(mean - ref)
                                                                          / (se + 1e-12)))


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_a_groups_tangent_reaches_only_its_own_loss():
    """One key, a float64 NumPy formula: the block's output cotangent is
    Σ_g (∇_{h_g} L_g · u_g) u_g / (B·G), with no term of one group's tangent on another's
    loss; and one group is the ungrouped local loss."""
    stack, grouped, p, batch = _problem()
    spec = jg.TangentSpec(1, "gaussian")
    one = jax.tree.map(lambda a: a[0], p["blocks"])
    own = one["local_head"]
    h_in = grouped.embed(p["embed"], batch["x"])
    example = lambda lg: stack.example_loss(lg, batch)  # noqa: E731
    losses = lambda h: sg.own_losses(grouped, own, h, example)  # noqa: E731
    fn = lambda m: grouped.block({"module": m}, h_in)  # noqa: E731
    key = jax.random.key(3)
    out, g = sg.grouped_act_grad(fn, one["module"], spec, key, 0, losses)
    u = np.asarray(sg._u(spec, key, 0, out)[0], np.float64)  # (B, D)
    grads = [np.asarray(jax.grad(lambda h: jnp.sum(losses(h)[gi]))(out), np.float64)
             for gi in range(G)]
    width = u.shape[1] // G
    cot = np.zeros_like(u)
    for gi in range(G):
        cols = slice(gi * width, (gi + 1) * width)
        d = np.sum(grads[gi][:, cols] * u[:, cols], axis=1)  # ∇L_g·u_g per example
        cot[:, cols] = d[:, None] * u[:, cols]
    cot /= u.shape[0] * G
    _, pull = jax.vjp(fn, one["module"])
    want = pull(jnp.asarray(cot, jnp.float32))[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, want)
    # one group: the ungrouped kernel's estimate, the same tangent
    _, g1 = sg.grouped_act_grad(fn, one["module"], spec, key, 0,
                                lambda h: jnp.mean(losses(h), axis=0)[None])
    _, ref = sg.local_act_grad(fn, one["module"], spec, key, 0,
                               lambda h: jnp.mean(losses(h), axis=0))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), g1, ref)


def test_grouped_heads_are_refused_where_they_cannot_hold():
    """What grouped local losses cannot honour is refused by name."""
    stack, grouped, p, batch = _problem()
    with pytest.raises(ValueError, match="groups: 3 must divide the embed' output features"):
        with_local_heads(stack, groups=3, x=batch["x"])
    with pytest.raises(ValueError, match="groups > 1 needs x="):
        with_local_heads(stack, groups=2)
    with pytest.raises(ValueError, match="a weight tangent reaches every group"):
        jg.local_forward_weights()(grouped, p, batch, jax.random.key(0))


def test_local_targets_are_the_gradient_of_the_local_objective():
    """``local_targets`` (what a diagnostic compares local-loss estimates with) is ∇J."""
    stack, grouped, p, batch = _problem()
    want = jax.grad(lambda q: _local_objective(stack, grouped, q, batch))(p)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 jg.local_targets(grouped, p, batch), want)
