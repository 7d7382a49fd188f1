"""Model stacks: the scanned stack equals a plain sequential loop; nnx wrapping."""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxstream.models import char_transformer, cnn, from_nnx, layer_slice, mlp, slice_blocks


def _sequential(stack, params, x):
    h = stack.embed(params["embed"], x)
    for l in range(stack.num_layers):
        h = stack.block(layer_slice(params, l), h)
    return stack.head(params["head"], h)


@pytest.mark.parametrize(
    "stack,x",
    [
        (mlp(12, 8, 3, 5), jnp.ones((2, 12))),
        (cnn((8, 8, 1), 4, 2, 10), jnp.linspace(0, 1, 2 * 64).reshape(2, 64)),
        (char_transformer(vocab=11, seq_len=6, d_model=8, num_heads=2, depth=2),
         jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % 11),
    ],
)
def test_stack_equals_sequential_loop(stack, x):
    params = stack.init(jax.random.key(0))
    chex.assert_trees_all_close(stack.apply(params, x), _sequential(stack, params, x), rtol=1e-5, atol=1e-6)
    other = stack.init(jax.random.key(1))
    assert not jnp.allclose(jax.tree.leaves(params["blocks"])[-1], jax.tree.leaves(other["blocks"])[-1])


def test_transformer_is_causal():
    stack = char_transformer(vocab=7, seq_len=5, d_model=8, num_heads=2, depth=1)
    params = stack.init(jax.random.key(0))
    x = jnp.array([[1, 2, 3, 4, 5]], jnp.int32)
    x2 = x.at[0, 4].set(6)
    a, b = stack.apply(params, x), stack.apply(params, x2)
    chex.assert_trees_all_close(a[:, :4], b[:, :4], atol=1e-6)


def test_user_nnx_blocks():
    rngs = nnx.Rngs(0)
    stack, params = from_nnx(nnx.Linear(3, 4, rngs=rngs), lambda l: nnx.Linear(4, 4, rngs=rngs),
                             nnx.Linear(4, 2, rngs=rngs), num_layers=3)
    assert jax.tree.leaves(params["blocks"])[0].shape[0] == 3
    batch = {"x": jnp.ones((5, 3)), "y": jnp.zeros((5,), jnp.int32)}
    assert jnp.isfinite(stack(params, batch))
    part = slice_blocks(params, 1, 3)
    assert jax.tree.leaves(part["blocks"])[0].shape[0] == 2
    with pytest.raises(ValueError, match="differs in structure"):
        from_nnx(nnx.Linear(3, 4, rngs=rngs), lambda l: nnx.Linear(4, 4 + l, rngs=rngs),
                 nnx.Linear(4, 2, rngs=rngs), num_layers=2)


def test_bad_model_arguments():
    with pytest.raises(ValueError, match="depth must be an int >= 1"):
        mlp(4, 4, 0, 2)
    with pytest.raises(ValueError, match="activation must be one of"):
        mlp(4, 4, 1, 2, activation="swish!")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        char_transformer(d_model=10, num_heads=3)
