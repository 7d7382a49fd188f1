"""Local-guess forward gradients against a float64 NumPy reference built from ``jax.grad`` of
each segment's local loss and ``jax.jvp`` of the global loss, written here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp, with_local_heads
from jaxstream.models.stack import cross_entropy

L = 2
STACK = mlp(in_dim=5, width=6, depth=L, num_classes=3)
OWN = with_local_heads(STACK)
RNG = np.random.default_rng(1)
BATCH = {"x": jnp.asarray(RNG.standard_normal((8, 5)), jnp.float32),
         "y": jnp.asarray(RNG.integers(0, 3, 8), jnp.int32)}


def ce(logits):
    return jnp.mean(cross_entropy(logits, BATCH))


def guesses(embed, blocks, head, head_of):
    """U: the embed's and each block's gradient of ce(head_of(segment, out)) with its input
    fixed; the head's gradient of the global loss."""
    at = lambda tree, l: jax.tree.map(lambda a: a[l], tree)
    u_embed = jax.grad(lambda m: ce(head_of("embed", STACK.embed(m, BATCH["x"]))))(embed)
    h = STACK.embed(embed, BATCH["x"])
    u_blocks = []
    for l in range(L):
        m = at(blocks, l)
        u_blocks.append(jax.grad(lambda m, h=h, l=l: ce(head_of(l, STACK.block(m, h))))(m))
        h = STACK.block(m, h)
    u_head = jax.grad(lambda q: ce(STACK.head(q, h)))(head)
    return {"embed": u_embed, "blocks": jax.tree.map(lambda *a: jnp.stack(a), *u_blocks),
            "head": u_head}


def projected(core, u):
    """float64: (∇L·U) U / ‖U‖², ∇L·U from jax.jvp of the base model's global loss."""
    _, d = jax.jvp(lambda p: STACK(p, BATCH), (core,), (u,))
    flat = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(u)])
    return jax.tree.map(lambda x: float(d) / float(flat @ flat) * np.asarray(x, np.float64), u)


def test_shared_head_guess_is_the_projection_on_the_local_gradients():
    params = STACK.init(jax.random.key(0))
    loss, g = jax.jit(lambda p: jg.local_guess()(STACK, p, BATCH))(params)
    u = guesses(params["embed"], params["blocks"], params["head"],
                lambda _, h: STACK.head(params["head"], h))
    want = projected(params, u)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8), g, want)
    assert float(loss) == pytest.approx(float(STACK(params, BATCH)))
    # never pointing away from the gradient; its cosine is the guess's
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
    exact = flat(jax.grad(STACK)(params, BATCH))
    cos = lambda a, b: a @ b / np.linalg.norm(a) / np.linalg.norm(b)
    assert flat(g) @ exact > 0
    assert cos(flat(g), exact) == pytest.approx(abs(cos(flat(u), exact)), rel=1e-4)


def test_own_heads_guess_and_train_their_heads_exactly():
    params = OWN.init(jax.random.key(0))
    _, g = jax.jit(lambda p: jg.local_guess()(OWN, p, BATCH))(params)
    emb, blk = params["embed"], params["blocks"]
    heads = {"embed": emb["local_head"],
             **{l: jax.tree.map(lambda a, l=l: a[l], blk["local_head"]) for l in range(L)}}
    u = guesses(emb["module"], blk["module"], params["head"],
                lambda seg, h: STACK.head(heads[seg], h))
    core = {"embed": emb["module"], "blocks": blk["module"], "head": params["head"]}
    want = projected(core, u)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    jax.tree.map(close, {"embed": g["embed"]["module"], "blocks": g["blocks"]["module"],
                         "head": g["head"]}, want)
    # each local head: the exact gradient of its own loss, its segment's output held fixed
    h = STACK.embed(emb["module"], BATCH["x"])
    close(g["embed"]["local_head"]["kernel"],
          jax.grad(lambda q: ce(STACK.head(q, h)))(heads["embed"])["kernel"])
    for l in range(L):
        h = STACK.block(jax.tree.map(lambda a, l=l: a[l], blk["module"]), h)
        close(g["blocks"]["local_head"]["kernel"][l],
              jax.grad(lambda q, h=h: ce(STACK.head(q, h)))(heads[l])["kernel"])


def test_it_trains_and_engines_that_cannot_run_it_refuse_by_name():
    """Forty Adam steps lower the loss; the pipeline, stream and composed engines run it
    (tests/pipeline/test_local_guess.py, tests/stream/test_local_guess.py); data parallel
    refuses only the shared-tangents promise it cannot keep."""
    params = STACK.init(jax.random.key(0))
    tx = optax.adam(3e-2)
    opt = tx.init(params)

    @jax.jit
    def step(p, o):
        loss, g = jg.local_guess()(STACK, p, BATCH)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    first = None
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: float ** int32
        for _ in range(40):
            params, opt, loss = step(params, opt)
            first = float(loss) if first is None else first
    assert float(STACK(params, BATCH)) < 0.5 * first

    from jax.sharding import Mesh

    from jaxstream.comm import data_parallel
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with pytest.raises(ValueError, match="tangents: 'shared'"):
        data_parallel(jg.local_guess(), mesh, tangents="shared")
    data_parallel(jg.local_guess(), mesh)  # each shard's estimate, averaged: allowed
