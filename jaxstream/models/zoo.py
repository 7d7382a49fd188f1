"""Ready-made stacks: an MLP, a small CNN and a decoder-only character transformer."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstream.models.nnx_stack import nnx_stack_factory
from jaxstream.models.stack import Stack

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "tanh": jnp.tanh,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
}


def _activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]


def _check_positive(**kwargs: int) -> None:
    for field, value in kwargs.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{field} must be an int >= 1, got {value!r}")


class _Dense(nnx.Module):
    """Linear layer followed by an activation."""

    def __init__(self, din: int, dout: int, act: str, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.act = _activation(act)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.act(self.linear(x))


def mlp(in_dim: int, width: int, depth: int, num_classes: int, activation: str = "tanh") -> Stack:
    """MLP: Dense(in_dim->width) -> depth x Dense(width->width) -> Linear(width->classes).

    Example:
      >>> stack = mlp(64, 128, 4, 10)
      >>> params = stack.init(jax.random.key(0))
    """
    _check_positive(in_dim=in_dim, width=width, depth=depth, num_classes=num_classes)
    _activation(activation)

    def build(rngs: nnx.Rngs):
        return (
            _Dense(in_dim, width, activation, rngs),
            lambda l: _Dense(width, width, activation, rngs),
            nnx.Linear(width, num_classes, rngs=rngs),
        )

    return nnx_stack_factory(build, depth, name=f"mlp{depth}x{width}")


class _ConvIn(nnx.Module):
    def __init__(self, image_shape: tuple[int, int, int], channels: int, rngs: nnx.Rngs):
        self.image_shape = tuple(image_shape)
        self.conv = nnx.Conv(image_shape[-1], channels, (3, 3), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0], *self.image_shape))
        return jax.nn.relu(self.conv(x))


class _ConvBlock(nnx.Module):
    def __init__(self, channels: int, rngs: nnx.Rngs):
        self.conv = nnx.Conv(channels, channels, (3, 3), rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + jax.nn.relu(self.conv(h))


class _PoolHead(nnx.Module):
    def __init__(self, channels: int, num_classes: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(channels, num_classes, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.linear(h.mean(axis=(1, 2)))


def cnn(
    image_shape: tuple[int, int, int] = (8, 8, 1),
    channels: int = 16,
    depth: int = 2,
    num_classes: int = 10,
) -> Stack:
    """Small residual CNN for 8x8 (digits) or 28x28 images; inputs may be flat (B, H*W*C)."""
    _check_positive(channels=channels, depth=depth, num_classes=num_classes)
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise ValueError(f"image_shape must be (height, width, channels), got {image_shape!r}")

    def build(rngs: nnx.Rngs):
        return (
            _ConvIn(tuple(image_shape), channels, rngs),
            lambda l: _ConvBlock(channels, rngs),
            _PoolHead(channels, num_classes, rngs),
        )

    return nnx_stack_factory(build, depth, name=f"cnn{depth}x{channels}")


class _TokenEmbed(nnx.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, rngs: nnx.Rngs):
        self.tok = nnx.Embed(vocab, d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.tok(x) + self.pos[: x.shape[1]]


class _DecoderBlock(nnx.Module):
    """Pre-LayerNorm causal self-attention + MLP, both residual."""

    def __init__(self, d_model: int, num_heads: int, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=num_heads, in_features=d_model, decode=False, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        t = h.shape[1]
        mask = jnp.tril(jnp.ones((1, 1, t, t), dtype=bool))
        h = h + self.attn(self.ln1(h), mask=mask)
        return h + self.down(jax.nn.gelu(self.up(self.ln2(h))))


class _LMHead(nnx.Module):
    def __init__(self, d_model: int, vocab: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d_model, rngs=rngs)
        self.out = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.out(self.ln(h))


def char_transformer(
    vocab: int = 32, seq_len: int = 32, d_model: int = 64, num_heads: int = 4, depth: int = 2
) -> Stack:
    """Decoder-only character transformer; batch ``x``, ``y``: int tokens (B, T), y = next char."""
    _check_positive(vocab=vocab, seq_len=seq_len, d_model=d_model, num_heads=num_heads, depth=depth)
    if d_model % num_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")

    def build(rngs: nnx.Rngs):
        return (
            _TokenEmbed(vocab, seq_len, d_model, rngs),
            lambda l: _DecoderBlock(d_model, num_heads, rngs),
            _LMHead(d_model, vocab, rngs),
        )

    return nnx_stack_factory(build, depth, name=f"transformer{depth}x{d_model}")
