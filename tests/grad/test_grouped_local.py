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
        one = jax.tree.map(lambda a, l=l: a[l], p["blocks"])
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


def _assert_unbiased(draws, target):
    """The mean of the R draws (leading axis) within 5 standard errors (from the sample
    variance) of ``target`` on every coordinate."""
    for path, got in jax.tree_util.tree_leaves_with_path(draws):
        ref, got = np.asarray(_at(target, path), np.float64), np.asarray(got, np.float64)
        mean, se = got.mean(0), got.std(0, ddof=1) / np.sqrt(got.shape[0])
        assert np.all(np.abs(mean - ref) <= 5 * se + 1e-6), jax.tree_util.keystr(path)


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
    example = lambda lg: stack.example_loss(lg, batch)
    losses = lambda h: sg.own_losses(grouped, own, h, example)
    fn = lambda m: grouped.block({"module": m}, h_in)
    key = jax.random.key(3)
    out, g = sg.grouped_act_grad(fn, one["module"], spec, key, 0, losses)
    u = np.asarray(sg._u(spec, key, 0, out)[0], np.float64)  # (B, D)
    grads = [np.asarray(jax.grad(lambda h, gi=gi: jnp.sum(losses(h)[gi]))(out), np.float64)
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
    with pytest.raises(ValueError, match=r"groups: 3 must divide the segments' output "
                                         r"features \(8\)"):
        with_local_heads(stack, groups=3, x=batch["x"])
    with pytest.raises(ValueError, match="over: 'positions' groups the tokens of a"):
        with_local_heads(stack, groups=2, x=batch["x"], over="positions")
    with pytest.raises(ValueError, match="over: must be 'features' or 'positions'"):
        with_local_heads(stack, groups=2, x=batch["x"], over="rows")
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


@pytest.mark.parametrize("groups", [0, 1, 4], ids=["shared-head", "own-heads", "4-groups"])
def test_local_losses_on_a_users_cnn_are_unbiased_for_their_targets(groups):
    """A user's nnx CNN (a repeated conv block, global average pooling, a linear head) as a
    stack: LG-FG-A with the shared head, with a head per block, and with 4 channel groups per
    block (each group's head pools its channels over the image) is unbiased for the local
    targets (checked against ∇J on the MLP above): the mean of R estimates lies within 5
    standard errors of them on every coordinate."""
    from flax import nnx

    from jaxstream.models import as_stack, from_sequential

    rngs = nnx.Rngs(0)
    model = from_sequential(nnx.Sequential(
        lambda x: x.reshape(x.shape[0], 6, 6, 1), nnx.Conv(1, 8, (3, 3), rngs=rngs), nnx.relu,
        *[m for _ in range(2) for m in (nnx.Conv(8, 8, (3, 3), rngs=rngs), nnx.relu)],
        lambda x: x.mean(axis=(1, 2)), nnx.Linear(8, 3, rngs=rngs)), name="cnn")
    view = as_stack(model)
    x = jax.random.normal(jax.random.key(1), (4, 36))
    batch = {"x": x, "y": jax.random.randint(jax.random.key(2), (4,), 0, 3)}
    stack = view.stack if groups == 0 else with_local_heads(view.stack, groups=groups, x=x)
    assert stack.num_layers == 2 and stack.local_groups == max(groups, 1)
    params = (view.params(model.init(jax.random.key(0))) if groups == 0
              else stack.init(jax.random.key(0)))
    est = jg.forward(perturb="activations", local_losses=True, num_tangents=1)
    target = jg.local_targets(stack, params, batch)
    r = 3000
    draws = jax.jit(jax.vmap(lambda k: est(stack, params, batch, k)[1]))(
        jax.random.split(jax.random.key(9), r))
    _assert_unbiased(draws, target)


def _mixer_problem(over: str, groups: int = 4):
    from jaxstream.models import mixer

    stack = mixer((4, 4, 1), patch=1, width=4, hidden=6, depth=2, num_classes=3)  # 16 tokens
    x = jax.random.normal(jax.random.key(1), (4, 16))
    batch = {"x": x, "y": jax.random.randint(jax.random.key(2), (4,), 0, 3)}
    grouped = with_local_heads(stack, groups=groups, x=x, over=over)
    return stack, grouped, grouped.init(jax.random.key(0)), batch


def test_a_patch_groups_tangent_reaches_only_its_own_loss():
    """Patch-wise groups on a Mixer (16 tokens in 4 groups of 4): one key, a float64 NumPy
    formula; the cotangent on group g's tokens is (∇_{h_g} L_g · u_g) u_g / (B·G)."""
    stack, grouped, p, batch = _mixer_problem("positions")
    assert grouped.local_cells == ((1, 4),)
    spec = jg.TangentSpec(1, "gaussian")
    one = jax.tree.map(lambda a: a[0], p["blocks"])
    h_in = grouped.embed(p["embed"], batch["x"])
    example = lambda lg: stack.example_loss(lg, batch)
    losses = lambda h: sg.own_losses(grouped, one["local_head"], h, example)
    fn = lambda m: grouped.block({"module": m}, h_in)
    key = jax.random.key(3)
    out, g = sg.grouped_act_grad(fn, one["module"], spec, key, 0, losses,
                                 cells=((1, 4),))
    u = np.asarray(sg._u(spec, key, 0, out)[0], np.float64)  # (B, T, D)
    cot = np.zeros_like(u)
    for gi in range(4):
        grad = np.asarray(jax.grad(lambda h, gi=gi: jnp.sum(losses(h)[gi]))(out), np.float64)
        rows = slice(gi * 4, (gi + 1) * 4)
        assert not np.any(np.delete(grad, np.s_[gi * 4:(gi + 1) * 4], axis=1))  # its own only
        d = np.sum(grad[:, rows] * u[:, rows], axis=(1, 2))
        cot[:, rows] = d[:, None, None] * u[:, rows]
    cot /= u.shape[0] * 4
    want = jax.vjp(fn, one["module"])[1](jnp.asarray(cot, jnp.float32))[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g, want)


@pytest.mark.parametrize("over", ["features", "positions"])
def test_local_losses_on_a_mixer_are_unbiased_for_their_targets(over):
    """The Mixer with channel groups and with patch groups (Ren et al.'s LocalMixer losses):
    the mean of R estimates within 5 standard errors of the local targets."""
    _, grouped, p, batch = _mixer_problem(over)
    est = jg.forward(perturb="activations", local_losses=True, num_tangents=1)
    target = jg.local_targets(grouped, p, batch)
    r = 3000
    draws = jax.jit(jax.vmap(lambda k: est(grouped, p, batch, k)[1]))(
        jax.random.split(jax.random.key(9), r))
    _assert_unbiased(draws, target)
