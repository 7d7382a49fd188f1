"""Data: scikit-learn digits, MNIST-1D, a synthetic and a real (standard-library) character
corpus, and seeded batches."""

from jaxstream.data.batches import batch_at, batch_indices, epoch_permutation, iterate_batches
from jaxstream.data.chars import load_chars, synthetic_text
from jaxstream.data.digits import Dataset, load_digits, train_test_split
from jaxstream.data.mnist1d import load_mnist1d
from jaxstream.data.text import load_text

__all__ = [
    "Dataset",
    "batch_at",
    "batch_indices",
    "epoch_permutation",
    "iterate_batches",
    "load_chars",
    "load_digits",
    "load_mnist1d",
    "load_text",
    "synthetic_text",
    "train_test_split",
]
