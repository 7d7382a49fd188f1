"""Ren et al.'s local losses: every block (and the embed) with a head of its own, learned by the
exact gradient of its local loss, against references written here from the base model's
functions and ``jax.grad`` alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp, with_local_heads
from jaxstream.models.stack import cross_entropy

L = 2
STACK = mlp(in_dim=5, width=6, depth=L, num_classes=3)
OWN = with_local_heads(STACK)
RNG = np.random.default_rng(0)
BATCH = {"x": jnp.asarray(RNG.standard_normal((8, 5)), jnp.float32),
         "y": jnp.asarray(RNG.integers(0, 3, 8), jnp.int32)}
ESTIMATORS = {"LG-FG-A": lambda k: jg.forward(k, perturb="activations", local_losses=True),
              "LG-FG-W": lambda k: jg.local_forward_weights(k, "gaussian")}


def ce(logits):
    return jnp.mean(cross_entropy(logits, BATCH))


def local_targets(params: dict) -> dict:
    """Each segment's exact local gradient: the embed's and block l's module by the gradient
    of its own head's loss with its input held fixed, each local head by the gradient of its
    loss with its segment's output held fixed, the final head by the global loss."""
    emb, blocks = params["embed"], params["blocks"]
    at = lambda tree, l: jax.tree.map(lambda a: a[l], tree)
    g_emb = jax.grad(lambda m, q: ce(STACK.head(q, STACK.embed(m, BATCH["x"]))), (0, 1))(
        emb["module"], emb["local_head"])
    h = STACK.embed(emb["module"], BATCH["x"])
    g_blocks = []
    for l in range(L):
        m, q = at(blocks["module"], l), at(blocks["local_head"], l)
        g_blocks.append(jax.grad(lambda m, q, h=h: ce(STACK.head(q, STACK.block(m, h))), (0, 1))(m, q))
        h = STACK.block(m, h)
    g_head = jax.grad(lambda q: ce(STACK.head(q, h)))(params["head"])
    stacked = lambda i: jax.tree.map(lambda *a: jnp.stack(a), *[g[i] for g in g_blocks])
    return {"embed": {"module": g_emb[0], "local_head": g_emb[1]},
            "blocks": {"module": stacked(0), "local_head": stacked(1)}, "head": g_head}


def test_the_model_keeps_its_output_and_gets_fresh_heads():
    params, base = OWN.init(jax.random.key(0)), STACK.init(jax.random.key(0))
    for part in ("embed", "blocks"):
        jax.tree.map(np.testing.assert_array_equal, params[part]["module"], base[part])
    assert float(OWN(params, BATCH)) == float(STACK(base, BATCH))
    heads = [params["embed"]["local_head"]["kernel"], *params["blocks"]["local_head"]["kernel"],
             params["head"]["kernel"]]
    assert heads[1].shape == heads[-1].shape == (6, 3)
    assert all(not np.allclose(a, b) for i, a in enumerate(heads) for b in heads[i + 1:])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_local_heads_follow_their_exact_local_gradient(name):
    params = OWN.init(jax.random.key(0))
    _, g = jax.jit(lambda p, k: ESTIMATORS[name](2)(OWN, p, BATCH, k))(params, jax.random.key(3))
    want = local_targets(params)
    for part in ("embed", "blocks"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                     g[part]["local_head"], want[part]["local_head"])


@pytest.mark.parametrize("name", ESTIMATORS)
def test_modules_follow_their_own_heads_loss_without_bias(name):
    """Over R keys the mean estimate of every module (and of the final head) is its exact
    local gradient within 5 standard errors; the shared-head design's mean is not (it follows
    another loss), so the comparison can fail."""
    params = OWN.init(jax.random.key(0))
    r = 4000
    keys = jax.random.split(jax.random.key(11), r)
    est = ESTIMATORS[name](1)
    draws = jax.jit(jax.vmap(lambda k: est(OWN, params, BATCH, k)[1]))(keys)
    want = local_targets(params)
    flat = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])
    parts = lambda t: {"embed": t["embed"]["module"], "blocks": t["blocks"]["module"],
                       "head": t["head"]}
    d = jax.vmap(lambda t: flat(parts(t)))(draws)
    mean, se = d.mean(0), d.std(0, ddof=1) / np.sqrt(r)
    z = np.abs(np.asarray((mean - flat(parts(want))) / (se + 1e-12)))
    assert z.max() < 5.0, f"{name}: max |bias| {z.max():.1f} standard errors"
    base = STACK.init(jax.random.key(0))  # the same modules, the shared head's local losses
    shared = jax.jit(jax.vmap(lambda k: est(STACK, base, BATCH, k)[1]))(keys)
    s = jax.vmap(flat)(shared)
    z_shared = np.abs(np.asarray((s.mean(0) - flat(parts(want))) / (se + 1e-12)))
    assert z_shared.max() > 20.0


def test_refusals_name_the_model():
    with pytest.raises(ValueError, match="already has local heads"):
        with_local_heads(OWN)
    with pytest.raises(TypeError, match="needs a model Stack"):
        with_local_heads(lambda p, b: 0.0)
    import dataclasses

    padded = dataclasses.replace(STACK, shared_head=False)  # as as_padded_stack builds them
    with pytest.raises(ValueError, match="padded stack"):
        with_local_heads(padded)
