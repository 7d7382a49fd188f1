"""scikit-learn's 8x8 digits (shipped with scikit-learn, no download) as a standardised split."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Dataset(NamedTuple):
    """Train and test arrays plus facts a model builder needs.

    Attributes:
      train: ``{"x": (n, ...), "y": (n, ...)}`` numpy arrays.
      test: same layout.
      info: e.g. ``{"in_dim": 64, "num_classes": 10}`` or ``{"vocab_size": 27, "seq_len": 32}``.
    """

    train: dict[str, np.ndarray]
    test: dict[str, np.ndarray]
    info: dict[str, int]


def split_sizes(n: int, test_fraction: float) -> tuple[int, int]:
    """(train, test) sizes of :func:`train_test_split` of ``n`` examples."""
    n_test = max(1, round(n * test_fraction))
    return n - n_test, n_test


def train_test_split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sorted train/test index arrays, a deterministic function of (n, fraction, seed)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction: must be in (0, 1), got {test_fraction}")
    perm = np.random.default_rng(seed).permutation(n)
    n_test = split_sizes(n, test_fraction)[1]
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


NUM_DIGITS = 1797  # scikit-learn's digits


def load_digits(
    seed: int = 0, test_fraction: float = 0.2, standardize: bool = True, images: bool = False
) -> Dataset:
    """The digits data set split by ``seed`` and standardised with the train statistics.

    Args:
      seed: split seed.
      test_fraction: share of the 1797 images held out for testing.
      standardize: subtract the train mean and divide by the train std (per pixel, floored).
      images: return x as (n, 8, 8, 1) images (for a CNN) instead of (n, 64) vectors.
    Returns:
      a :class:`Dataset` with float32 ``x`` and int32 ``y``.

    Example:
      >>> ds = load_digits(seed=0)
      >>> ds.train["x"].shape, ds.info["num_classes"]
      ((1438, 64), 10)
    """
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    x = raw.data.astype(np.float64)
    y = raw.target.astype(np.int32)
    tr, te = train_test_split(len(y), test_fraction, seed)
    if standardize:
        mean = x[tr].mean(axis=0)
        std = np.maximum(x[tr].std(axis=0), 1.0)  # constant border pixels would divide by ~0
        x = (x - mean) / std
    else:
        x = x / 16.0
    x = x.astype(np.float32)
    if images:
        x = x.reshape(-1, 8, 8, 1)
    info = {"in_dim": 64, "num_classes": 10, "num_train": len(tr), "num_test": len(te)}
    return Dataset({"x": x[tr], "y": y[tr]}, {"x": x[te], "y": y[te]}, info)
