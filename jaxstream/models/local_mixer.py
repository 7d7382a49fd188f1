"""LocalMixer (Ren et al., ICLR 2023): an MLP-Mixer whose channel groups stay apart, built for
local losses per patch and per group of channels.

A block, on tokens h (B, T, D) with G channel groups:

* token mixing: a linear map across the T tokens (shared by the channels), a parameter-free
  layer norm over each token's channels, ReLU;
* channel mixing: a linear map D → H, layer norm, ReLU; then a *grouped* linear map: group g's
  H/G units to its D/G output channels only (block-diagonal), layer-normed within the group;
* the block's input added back, ReLU.

So the last layer of every block writes each channel group from its own weights, and the
group's layer norm keeps the groups' scales apart: a local loss per (patch, group) cell
(:func:`~jaxstream.models.with_local_heads` with ``groups=G, patch_groups=P,
aggregate=True``) then trains the weights that write that cell.

Differences from Ren et al.'s code, said here so that nobody reads them as the same: their
first block is a channel MLP on the raw patches (here a linear patch embedding, the embed
segment), and they perturb and attach local losses after each of a block's three linear
layers (here at the block's output: the library's segments are embed, blocks, head).

Example:
  >>> stack = local_mixer((8, 8, 1), patch=2, width=32, hidden=64, depth=2, groups=4)
  >>> cells = with_local_heads(stack, groups=4, patch_groups=16, x=x[:2], aggregate=True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxstream.models.nnx_stack import nnx_stack_factory
from jaxstream.models.stack import Stack
from jaxstream.models.zoo import _check_positive, _Patches, patch_tokens


def _norm(x: jax.Array) -> jax.Array:
    """Layer norm without scale or offset over the last axis (as Ren et al.'s blocks)."""
    return jax.nn.standardize(x, axis=-1, epsilon=1e-5)


class _GroupLinear(nnx.Module):
    """G independent linear maps, group g's ``fan_in`` inputs to its ``fan_out`` outputs."""

    def __init__(self, groups: int, fan_in: int, fan_out: int, rngs: nnx.Rngs):
        self.groups = groups
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.kernel = nnx.Param(init(rngs.params(), (groups, fan_in, fan_out)))
        self.bias = nnx.Param(jnp.zeros((groups, fan_out)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` (..., G·fan_in) → (..., G, fan_out)."""
        xg = x.reshape(x.shape[:-1] + (self.groups, -1))
        return jnp.einsum("...gi,gio->...go", xg, self.kernel[...]) + self.bias[...]


class _LocalMixerBlock(nnx.Module):
    def __init__(self, tokens: int, width: int, hidden: int, groups: int, rngs: nnx.Rngs):
        self.token = nnx.Linear(tokens, tokens, rngs=rngs)
        self.channel = nnx.Linear(width, hidden, rngs=rngs)
        self.grouped = _GroupLinear(groups, hidden // groups, width // groups, rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        y = jax.nn.relu(_norm(self.token(h.swapaxes(1, 2)).swapaxes(1, 2)))
        y = jax.nn.relu(_norm(self.channel(y)))
        y = _norm(self.grouped(y)).reshape(h.shape)  # each group normed on its own
        return jax.nn.relu(y + h)


class _TokenMeanLinear(nnx.Module):
    """The tokens' mean, then a linear read-out (Ren et al.'s classifier head)."""

    def __init__(self, width: int, num_classes: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, num_classes, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return self.linear(h.mean(axis=1))


def local_mixer(
    image_shape: tuple[int, int, int] = (8, 8, 1),
    patch: int = 2,
    width: int = 32,
    hidden: int = 64,
    depth: int = 2,
    groups: int = 4,
    num_classes: int = 10,
) -> Stack:
    """LocalMixer on ``patch``×``patch`` patches: ``depth`` blocks of token mixing, a channel
    MLP through ``hidden`` units whose second layer is grouped into ``groups`` channel groups,
    and a linear head on the tokens' mean (see the module's docstring).

    Raises:
      ValueError: a size not a positive int, ``patch`` not dividing the image, or ``groups``
        not dividing ``width`` and ``hidden``.
    """
    _check_positive(patch=patch, width=width, hidden=hidden, depth=depth, groups=groups,
                    num_classes=num_classes)
    tokens = patch_tokens(image_shape, patch)
    if width % groups or hidden % groups:
        raise ValueError(f"groups: {groups} must divide width ({width}) and hidden ({hidden})")

    def build(rngs: nnx.Rngs):
        return (
            _Patches(tuple(image_shape), patch, width, rngs),
            lambda l: _LocalMixerBlock(tokens, width, hidden, groups, rngs),
            _TokenMeanLinear(width, num_classes, rngs),
        )

    return nnx_stack_factory(build, depth, name=f"localmixer{depth}x{width}/g{groups}",
                             num_classes=num_classes)
