"""Model sections of a config: ``model: {type: mlp, width: 64, depth: 2}`` -> a model stack.

``build(info)`` takes the data set's facts (``in_dim``, ``num_classes``, ``vocab_size``,
``seq_len``) so the YAML only states what is a modelling choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jaxstream.experiment.config import register_choice


class ModelConfig:
    """Base of the polymorphic ``model:`` section."""

    def build(self, info: dict[str, int]) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


def _need(info: dict[str, int], key: str, model: str) -> int:
    if key not in info:
        raise ValueError(f"model: {model!r} needs data with {key!r}; the data gives {sorted(info)}")
    return info[key]


@register_choice(ModelConfig, "mlp")
@dataclasses.dataclass(frozen=True)
class MLPConfig(ModelConfig):
    """MLP: Dense(in->width) -> depth x Dense(width->width) -> Linear(width->classes)."""

    width: int = 64
    depth: int = 2
    activation: Literal["tanh", "relu", "gelu"] = "tanh"

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import mlp

        return mlp(_need(info, "in_dim", "mlp"), self.width, self.depth,
                   _need(info, "num_classes", "mlp"), activation=self.activation)


@register_choice(ModelConfig, "cnn")
@dataclasses.dataclass(frozen=True)
class CNNConfig(ModelConfig):
    """Small residual CNN on 8x8x1 images (inputs may be flat)."""

    channels: int = 16
    depth: int = 2
    image_shape: tuple[int, int, int] = (8, 8, 1)

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import cnn

        return cnn(self.image_shape, self.channels, self.depth, _need(info, "num_classes", "cnn"))


@register_choice(ModelConfig, "char_transformer")
@dataclasses.dataclass(frozen=True)
class CharTransformerConfig(ModelConfig):
    """Decoder-only character transformer (data: ``type: chars``)."""

    d_model: int = 64
    num_heads: int = 4
    depth: int = 2

    def build(self, info: dict[str, int]) -> Any:
        from jaxstream.models import char_transformer

        return char_transformer(_need(info, "vocab_size", "char_transformer"),
                                _need(info, "seq_len", "char_transformer"),
                                self.d_model, self.num_heads, self.depth)
