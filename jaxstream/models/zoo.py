"""Ready-made stacks: an MLP, a small CNN and a decoder-only character transformer."""

from __future__ import annotations

from collections.abc import Callable

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

    return nnx_stack_factory(build, depth, name=f"mlp{depth}x{width}", num_classes=num_classes)


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

    return nnx_stack_factory(build, depth, name=f"cnn{depth}x{channels}",
                             num_classes=num_classes)


def patch_tokens(image_shape: tuple[int, int, int], patch: int) -> int:
    """The tokens of an image cut into ``patch``×``patch`` patches (a Mixer's sequence).

    Raises:
      ValueError: ``image_shape`` not (height, width, channels), or ``patch`` not dividing it.
    """
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise ValueError(f"image_shape must be (height, width, channels), got {image_shape!r}")
    if image_shape[0] % patch or image_shape[1] % patch:
        raise ValueError(f"patch: {patch} must divide the image's height and width "
                         f"{tuple(image_shape[:2])}")
    return (image_shape[0] // patch) * (image_shape[1] // patch)


class _Patches(nnx.Module):
    """Cut an image into non-overlapping ``patch``×``patch`` patches, each linearly embedded."""

    def __init__(self, image_shape: tuple[int, int, int], patch: int, width: int,
                 rngs: nnx.Rngs):
        self.image_shape, self.patch = tuple(image_shape), patch
        self.linear = nnx.Linear(patch * patch * image_shape[-1], width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        (h, w, c), p, b = self.image_shape, self.patch, x.shape[0]
        x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        return self.linear(x.reshape(b, (h // p) * (w // p), p * p * c))


class _MixerBlock(nnx.Module):
    """MLP-Mixer block: an MLP across the tokens, then one across the channels, each residual
    on a layer-normed input (Tolstikhin et al., 2021)."""

    def __init__(self, tokens: int, width: int, hidden: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.token1, self.token2 = (nnx.Linear(tokens, hidden, rngs=rngs),
                                    nnx.Linear(hidden, tokens, rngs=rngs))
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.channel1, self.channel2 = (nnx.Linear(width, hidden, rngs=rngs),
                                        nnx.Linear(hidden, width, rngs=rngs))

    def __call__(self, h: jax.Array) -> jax.Array:
        y = self.norm1(h).swapaxes(1, 2)  # (B, width, tokens)
        h = h + self.token2(jax.nn.gelu(self.token1(y))).swapaxes(1, 2)
        return h + self.channel2(jax.nn.gelu(self.channel1(self.norm2(h))))


class _TokenMeanHead(nnx.Module):
    def __init__(self, width: int, num_classes: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.linear = nnx.Linear(width, num_classes, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.linear(self.norm(h).mean(axis=1))


def mixer(
    image_shape: tuple[int, int, int] = (8, 8, 1),
    patch: int = 2,
    width: int = 32,
    hidden: int = 64,
    depth: int = 2,
    num_classes: int = 10,
) -> Stack:
    """MLP-Mixer on ``patch``×``patch`` patches: blocks of a token MLP and a channel MLP
    (``hidden`` units each), a head on the tokens' mean. Every block's output is (B, tokens,
    width): local losses per token group (:func:`~jaxstream.models.with_local_heads` with
    ``over="positions"``) or per channel group apply to it, as in Ren et al.'s LocalMixer.

    Example:
      >>> stack = mixer((8, 8, 1), patch=2, width=32, depth=4)   # 16 tokens of 4 pixels
    """
    _check_positive(patch=patch, width=width, hidden=hidden, depth=depth,
                    num_classes=num_classes)
    tokens = patch_tokens(image_shape, patch)

    def build(rngs: nnx.Rngs):
        return (
            _Patches(tuple(image_shape), patch, width, rngs),
            lambda l: _MixerBlock(tokens, width, hidden, rngs),
            _TokenMeanHead(width, num_classes, rngs),
        )

    return nnx_stack_factory(build, depth, name=f"mixer{depth}x{width}",
                             num_classes=num_classes)


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

    return nnx_stack_factory(build, depth, name=f"transformer{depth}x{d_model}",
                             num_classes=vocab)
