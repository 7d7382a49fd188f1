"""Ren et al.'s LocalMixer losses: a local loss per (patch group, channel group) cell, with a
head per cell or with their feature aggregator (one head on the whole output, every other cell
held fixed), and the LocalMixer block itself.

The references are written here from the definitions (float64 NumPy, ``jax.grad`` of a loss
spelled out), not from the library's helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.grad import segments as sg
from jaxstream.models import local_mixer, with_local_heads

P, G = 4, 2  # patch groups (of 16 tokens), channel groups (of 4 channels)


def _problem(aggregate: bool, patches: int = P, groups: int = G):
    stack = local_mixer((8, 8, 1), patch=2, width=8, hidden=8, depth=2, groups=2,
                        num_classes=3)  # 16 tokens of 2 × 2 pixels
    x = jax.random.normal(jax.random.key(1), (4, 64))
    batch = {"x": x, "y": jax.random.randint(jax.random.key(2), (4,), 0, 3)}
    cells = with_local_heads(stack, groups=groups, patch_groups=patches, x=x,
                             aggregate=aggregate)
    return stack, cells, cells.init(jax.random.key(0)), batch


def _ce(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def _assert_unbiased(draws, target, sigmas: float = 5.0):
    """The mean of the R draws (leading axis) within ``sigmas`` standard errors (from the
    sample variance) of ``target`` on every coordinate."""
    for (path, got), ref in zip(jax.tree_util.tree_leaves_with_path(draws),
                                jax.tree.leaves(target)):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        mean, se = got.mean(0), got.std(0, ddof=1) / np.sqrt(got.shape[0])
        assert np.all(np.abs(mean - ref) <= sigmas * se + 1e-6), jax.tree_util.keystr(path)


def test_a_cells_tangent_reaches_only_its_own_loss():
    """4 patch groups × 2 channel groups, a head per cell: cell (p, g)'s loss reads its cell
    only, and the block's output cotangent is Σ_c (∇_c L_c · u_c) u_c / (B·C) (float64)."""
    stack, cells, p, batch = _problem(aggregate=False)
    assert cells.local_groups == P * G and cells.local_cells == ((1, P), (2, G))
    spec = jg.TangentSpec(1, "gaussian")
    one = jax.tree.map(lambda a: a[0], p["blocks"])
    h_in = cells.embed(p["embed"], batch["x"])
    losses = lambda h: sg.own_losses(cells, one["local_head"], h,
                                     lambda lg: stack.example_loss(lg, batch))
    fn = lambda m: cells.block({"module": m}, h_in)
    key = jax.random.key(3)
    out, g = sg.grouped_act_grad(fn, one["module"], spec, key, 0, losses, cells.local_cells)
    u = np.asarray(sg._u(spec, key, 0, out)[0], np.float64)  # (B, 16, 8)
    cot = np.zeros_like(u)
    for c in range(P * G):
        rows, cols = slice(4 * (c // G), 4 * (c // G + 1)), slice(4 * (c % G), 4 * (c % G + 1))
        grad = np.asarray(jax.grad(lambda h, c=c: jnp.sum(losses(h)[c]))(out), np.float64)
        outside = grad.copy()
        outside[:, rows, cols] = 0
        assert not np.any(outside), c  # its own cell only
        d = np.sum(grad[:, rows, cols] * u[:, rows, cols], axis=(1, 2))
        cot[:, rows, cols] = d[:, None, None] * u[:, rows, cols]
    cot /= u.shape[0] * P * G
    want = jax.vjp(fn, one["module"])[1](jnp.asarray(cot, jnp.float32))[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, want)


def _aggregated_objective(stack, p, batch):
    """Ren et al.'s aggregated local objective, spelled out: per segment, the segment's own head
    (a copy of the final head) on its whole output, its input held fixed; + the global loss."""
    y = batch["y"]
    h = stack.embed(p["embed"]["module"], batch["x"])
    total = jnp.mean(_ce(stack.head(p["embed"]["local_head"], h), y))
    for l in range(stack.num_layers):
        one = jax.tree.map(lambda a, l=l: a[l], p["blocks"])
        h = stack.block(one["module"], jax.lax.stop_gradient(h))
        total += jnp.mean(_ce(stack.head(one["local_head"], h), y))
    return total + jnp.mean(_ce(stack.head(p["head"], jax.lax.stop_gradient(h)), y))


def test_aggregated_cells_have_one_value_and_the_one_losss_gradient():
    """Every cell's loss under the feature aggregator is the head's loss on the whole output;
    the local targets are the gradient of the aggregated objective; LG-FG-A over the 8 cells
    is unbiased for it (the mean of R estimates within 5 standard errors of ``jax.grad``)."""
    stack, cells, p, batch = _problem(aggregate=True)
    assert cells.local_groups == P * G
    own = p["embed"]["local_head"]
    h = cells.embed(p["embed"], batch["x"])
    each = sg.own_losses(cells, own, h, lambda lg: stack.example_loss(lg, batch))
    np.testing.assert_allclose(each, np.broadcast_to(_ce(stack.head(own, h), batch["y"]),
                                                     each.shape), rtol=1e-6, atol=1e-6)
    want = jax.grad(lambda q: _aggregated_objective(stack, q, batch))(p)
    # float32: C scaled pieces summed against one gradient (|grads| ~ 1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6),
                 jg.local_targets(cells, p, batch), want)
    est = jg.forward(perturb="activations", local_losses=True, num_tangents=1)
    draws = jax.jit(jax.vmap(lambda k: est(cells, p, batch, k)[1]))(
        jax.random.split(jax.random.key(9), 3000))
    _assert_unbiased(draws, want)


def test_the_aggregator_cuts_the_variance_of_one_loss_per_block():
    """Same heads, same target (the one loss per block): spread over 4 × 2 cells, the tangents'
    directional derivatives are independent per cell, and the estimate's total variance drops
    below that of one tangent on the whole output. Seeds fixed; the bound leaves the ratio's
    sampling error (relative SE √(2/R) per variance, R = 2000) many times over."""
    stack, cells, p, batch = _problem(aggregate=True)
    one = with_local_heads(stack)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                                     one.init(jax.random.key(0)), p))  # the same heads
    est = jg.forward(perturb="activations", local_losses=True, num_tangents=1)
    keys = jax.random.split(jax.random.key(11), 2000)

    def total_variance(stack_):
        draws = jax.jit(jax.vmap(lambda k: est(stack_, p, batch, k)[1]))(keys)
        blocks = jax.tree.leaves(draws["blocks"]["module"])
        return sum(float(np.var(np.asarray(x, np.float64), axis=0, ddof=1).sum())
                   for x in blocks)

    ratio = total_variance(cells) / total_variance(one)
    assert ratio < 0.75, ratio


def test_the_local_mixer_block_is_its_definition():
    """One LocalMixer block against a float64 NumPy formula of its definition (token linear,
    norm, ReLU; channel linear, norm, ReLU; block-diagonal grouped linear, norm per group;
    residual, ReLU)."""
    stack = local_mixer((4, 4, 1), patch=1, width=8, hidden=6, depth=1, groups=2,
                        num_classes=3)
    p = jax.tree.map(lambda a: np.asarray(a[0], np.float64), stack.init(jax.random.key(0))
                     ["blocks"])
    h = np.asarray(jax.random.normal(jax.random.key(4), (3, 16, 8)), np.float64)

    def norm(x):
        return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)

    relu = lambda x: np.maximum(x, 0)
    y = relu(norm(np.einsum("bdt,ts->bds", h.swapaxes(1, 2), p["token"]["kernel"])
                  .swapaxes(1, 2) + p["token"]["bias"][None, :, None]))
    y = relu(norm(y @ p["channel"]["kernel"] + p["channel"]["bias"]))
    w, b = p["grouped"]["kernel"], p["grouped"]["bias"]  # (2, 3, 4), (2, 4)
    out = np.concatenate([norm(y[..., 3 * g:3 * (g + 1)] @ w[g] + b[g]) for g in range(2)], -1)
    want = relu(out + h)
    got = stack.block(jax.tree.map(jnp.asarray, p), jnp.asarray(h, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_what_cells_cannot_honour_is_refused():
    stack, _, _, batch = _problem(aggregate=True)
    x = batch["x"]
    with pytest.raises(ValueError, match="patch_groups: over='positions' already splits"):
        with_local_heads(stack, groups=2, patch_groups=2, x=x, over="positions")
    with pytest.raises(ValueError, match=r"groups: 3 must divide the segments' positions"):
        with_local_heads(stack, patch_groups=3, x=x)
    with pytest.raises(ValueError, match="aggregate: the feature aggregator splits"):
        with_local_heads(stack, aggregate=True)
    with pytest.raises(ValueError, match="patch_groups: must be an integer >= 1"):
        with_local_heads(stack, patch_groups=0, x=x)
    with pytest.raises(ValueError, match=r"groups: 3 must divide width \(8\) and hidden"):
        local_mixer((4, 4, 1), patch=1, width=8, hidden=8, groups=3)
    from jaxstream.models import mlp

    with pytest.raises(ValueError, match="over: 'positions' groups the tokens"):
        with_local_heads(mlp(64, 8, 1, 3), patch_groups=2, x=x)
