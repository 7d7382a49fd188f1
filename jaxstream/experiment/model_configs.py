"""Model sections of a config: ``model: {type: mlp, width: 64, depth: 2}`` -> a model stack.

``build(info)`` takes the data set's facts (``in_dim``, ``num_classes``, ``vocab_size``,
``seq_len``) so the YAML only states what is a modelling choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxstream.experiment.config import register_choice
from jaxstream.ranges import Checked, Count


class ModelConfig(Checked):
    """Base of the polymorphic ``model:`` section."""

    def build(self, info: dict[str, int]) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


def _estimate(layer_params: int, depth: int, acts_per_sample: int, batch: int,
              per_layer: bool, tangents: int = 1) -> int:
    """Bytes: fp32 parameters x 4 (params, gradients, two optimizer moments) of the whole
    model (or of one layer when streamed), plus fp32 activations and their tangents, plus
    the ``tangents`` of one layer's weights and activations that a K-tangent jvp holds at once.
    A lower bound: embedding and head are left out, so it never refuses a model that fits."""
    params = layer_params * (1 if per_layer else depth)
    acts = 2 * batch * acts_per_sample * (1 if per_layer else depth)
    jvp = (tangents - 1) * (layer_params + batch * acts_per_sample)
    return 4 * (4 * params + acts + jvp)


def _need(info: dict[str, int], key: str, model: str) -> int:
    if key not in info:
        raise ValueError(f"model: {model!r} needs data with {key!r}; the data gives {sorted(info)}")
    return info[key]


@register_choice(ModelConfig, "mlp")
@dataclasses.dataclass(frozen=True)
class MLPConfig(ModelConfig):
    """MLP: Dense(in->width) -> depth x Dense(width->width) -> Linear(width->classes)."""

    width: Count = 64
    depth: Count = 2
    activation: Literal["tanh", "relu", "gelu"] = "tanh"

    def memory_estimate(self, batch_size: int, per_layer: bool = False,
                        tangents: int = 1) -> int:
        """A lower bound of the bytes a training step needs (see :func:`_estimate`)."""
        return _estimate(self.width * (self.width + 1), self.depth, self.width, batch_size,
                         per_layer, tangents)

    def block_params(self) -> int:
        """Parameters of the blocks (embed and head left out: a lower bound)."""
        return self.width * (self.width + 1) * self.depth

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import mlp

        return mlp(_need(info, "in_dim", "mlp"), self.width, self.depth,
                   _need(info, "num_classes", "mlp"), activation=self.activation)


@register_choice(ModelConfig, "cnn")
@dataclasses.dataclass(frozen=True)
class CNNConfig(ModelConfig):
    """Small residual CNN on 8x8x1 images (inputs may be flat)."""

    channels: Count = 16
    depth: Count = 2
    image_shape: tuple[Count, Count, Count] = (8, 8, 1)

    def check(self) -> None:
        if any(isinstance(d, bool) or not isinstance(d, int) for d in self.image_shape):
            raise ValueError(f"image_shape: sizes must be integers >= 1, got {self.image_shape}")

    def memory_estimate(self, batch_size: int, per_layer: bool = False,
                        tangents: int = 1) -> int:
        """A lower bound of the bytes a training step needs (see :func:`_estimate`)."""
        h, w, _ = self.image_shape
        c = self.channels
        return _estimate(9 * c * c, self.depth, h * w * c, batch_size, per_layer, tangents)

    def block_params(self) -> int:
        """Parameters of the blocks (embed and head left out: a lower bound)."""
        return 9 * self.channels ** 2 * self.depth

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import cnn

        return cnn(self.image_shape, self.channels, self.depth, _need(info, "num_classes", "cnn"))


@register_choice(ModelConfig, "mixer")
@dataclasses.dataclass(frozen=True)
class MixerConfig(ModelConfig):
    """MLP-Mixer on ``patch``×``patch`` patches of images (inputs may be flat): a token MLP and
    a channel MLP of ``hidden`` units per block, a head on the tokens' mean."""

    patch: Count = 2
    width: Count = 32
    hidden: Count = 64
    depth: Count = 2
    image_shape: tuple[Count, Count, Count] = (8, 8, 1)

    def check(self) -> None:
        h, w, _ = self.image_shape
        if h % self.patch or w % self.patch:
            raise ValueError(f"patch: {self.patch} must divide image_shape's height and width "
                             f"({h}, {w})")

    def tokens(self) -> int:
        return (self.image_shape[0] // self.patch) * (self.image_shape[1] // self.patch)

    def block_params(self) -> int:
        """Parameters of the blocks (embed and head left out: a lower bound)."""
        return 2 * self.hidden * (self.tokens() + self.width) * self.depth

    def memory_estimate(self, batch_size: int, per_layer: bool = False,
                        tangents: int = 1) -> int:
        """A lower bound of the bytes a training step needs (see :func:`_estimate`)."""
        return _estimate(self.block_params() // self.depth, self.depth,
                         self.tokens() * self.width, batch_size, per_layer, tangents)

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import mixer

        return mixer(self.image_shape, self.patch, self.width, self.hidden, self.depth,
                     _need(info, "num_classes", "mixer"))


@register_choice(ModelConfig, "local_mixer")
@dataclasses.dataclass(frozen=True)
class LocalMixerConfig(MixerConfig):
    """Ren et al.'s LocalMixer (:func:`jaxstream.models.local_mixer`): a Mixer whose channel
    MLP's second layer is grouped into ``groups`` channel groups, each normed on its own."""

    groups: Count = 4

    def check(self) -> None:
        super().check()
        if self.width % self.groups or self.hidden % self.groups:
            raise ValueError(f"groups: {self.groups} must divide width ({self.width}) and "
                             f"hidden ({self.hidden})")

    def block_params(self) -> int:
        """Parameters of the blocks (embed and head left out: a lower bound)."""
        per = self.tokens() ** 2 + self.width * self.hidden + self.hidden * self.width // self.groups
        return per * self.depth

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import local_mixer

        return local_mixer(self.image_shape, self.patch, self.width, self.hidden, self.depth,
                           self.groups, _need(info, "num_classes", "local_mixer"))


@register_choice(ModelConfig, "char_transformer")
@dataclasses.dataclass(frozen=True)
class CharTransformerConfig(ModelConfig):
    """Decoder-only character transformer (data: ``type: chars``)."""

    d_model: Count = 64
    num_heads: Count = 4
    depth: Count = 2

    def check(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"num_heads: must divide d_model={self.d_model}, got {self.num_heads}")

    def memory_estimate(self, batch_size: int, per_layer: bool = False,
                        tangents: int = 1) -> int:
        """A lower bound of the bytes a training step needs (see :func:`_estimate`)."""
        return _estimate(12 * self.d_model ** 2, self.depth, self.d_model, batch_size, per_layer,
                         tangents)

    def block_params(self) -> int:
        """Parameters of the blocks (embed and head left out: a lower bound)."""
        return 12 * self.d_model ** 2 * self.depth

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import char_transformer

        return char_transformer(_need(info, "vocab_size", "char_transformer"),
                                _need(info, "seq_len", "char_transformer"),
                                self.d_model, self.num_heads, self.depth)
