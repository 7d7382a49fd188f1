"""Data: scikit-learn digits, a synthetic character corpus, and seeded batches."""

from jaxstream.data.batches import batch_at, batch_indices, epoch_permutation, iterate_batches
from jaxstream.data.chars import load_chars, synthetic_text
from jaxstream.data.digits import Dataset, load_digits, train_test_split

__all__ = [
    "Dataset",
    "batch_at",
    "batch_indices",
    "epoch_permutation",
    "iterate_batches",
    "load_chars",
    "load_digits",
    "synthetic_text",
    "train_test_split",
]
