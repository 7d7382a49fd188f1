"""Small shared fixtures for estimator tests."""

import jax
import jax.numpy as jnp

from jaxstream.models import mlp


def tiny_problem(n_micro: int = 4, per_micro: int = 4, depth: int = 3, seed: int = 0):
    """A tiny MLP stack, its params, a flat batch and the same batch split into micro-batches."""
    stack = mlp(in_dim=5, width=4, depth=depth, num_classes=3)
    params = stack.init(jax.random.key(seed))
    b = n_micro * per_micro
    x = jax.random.normal(jax.random.key(seed + 1), (b, 5))
    y = jnp.arange(b, dtype=jnp.int32) % 3
    batch = {"x": x, "y": y}
    micro = jax.tree.map(lambda a: a.reshape(n_micro, per_micro, *a.shape[1:]), batch)
    return stack, params, batch, micro


def flat(tree) -> jax.Array:
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(tree)])


def estimates(est, loss_fn, params, batch, keys) -> jax.Array:
    """Flat estimates for each key, shape (R, P). ``lax.map`` compiles the estimator once (a
    vmap over keys compiles a batched copy, several times slower to build on CPU)."""
    return jax.jit(lambda ks: jax.lax.map(lambda k: flat(est(loss_fn, params, batch, k)[1]), ks))(keys)
