"""Data sections of a config: ``data: {type: digits, ...}`` or ``data: {type: chars, ...}``."""

from __future__ import annotations

import dataclasses

from jaxstream.data.chars import load_chars
from jaxstream.data.digits import Dataset, load_digits
from jaxstream.experiment.config import register_choice


class DataConfig:
    """Base of the polymorphic ``data:`` section; ``load(seed)`` returns a :class:`Dataset`."""

    def load(self, seed: int) -> Dataset:  # pragma: no cover - interface
        raise NotImplementedError


@register_choice(DataConfig, "digits")
@dataclasses.dataclass(frozen=True)
class DigitsDataConfig(DataConfig):
    """scikit-learn digits: 1797 8x8 images, 10 classes.

    Attributes:
      test_fraction: share held out for testing.
      standardize: per-pixel standardisation with train statistics (else x / 16).
      split_seed: seed of the train/test split (None: the experiment seed).
    """

    test_fraction: float = 0.2
    standardize: bool = True
    split_seed: int | None = None

    def __post_init__(self):
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction: must be in (0, 1), got {self.test_fraction}")

    def load(self, seed: int) -> Dataset:
        split = seed if self.split_seed is None else self.split_seed
        return load_digits(split, self.test_fraction, self.standardize)


@register_choice(DataConfig, "chars")
@dataclasses.dataclass(frozen=True)
class CharsDataConfig(DataConfig):
    """Synthetic character corpus (next-character prediction), see :mod:`jaxstream.data.chars`."""

    seq_len: int = 32
    num_train: int = 2048
    num_test: int = 256
    num_words: int = 24

    def __post_init__(self):
        for name in ("seq_len", "num_train", "num_test", "num_words"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    def load(self, seed: int) -> Dataset:
        return load_chars(seed, self.seq_len, self.num_train, self.num_test, self.num_words)
