"""A user's own classification arrays from an ``.npz`` file (``x``, integer ``y``), split and
standardised as the digits are: MNIST, CIFAR or any data a researcher already has on disk
(nothing is downloaded).

Example:
    >>> np.savez("mnist.npz", x=images, y=labels)        # images (n, ...), labels (n,)
    >>> ds = load_npz("mnist.npz", seed=0)
    # experiment YAML:  data: {type: npz, path: mnist.npz}
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxstream.data.digits import Dataset, train_test_split


def load_npz(path: str | Path, seed: int = 0, test_fraction: float = 0.2,
             standardize: bool = True, flatten: bool = True) -> Dataset:
    """The arrays ``x`` (n, ...) and ``y`` (n,) of ``path``, split by ``seed``.

    Args:
      path: an ``.npz`` file with arrays ``x`` and ``y`` (integer class labels 0..C−1).
      seed: split seed.
      test_fraction: share held out for testing.
      standardize: subtract the train mean and divide by the train std (per feature, floored
        at 1e-6 of the largest), else keep the values (as float32).
      flatten: x as (n, features) for an MLP; False keeps each example's shape (for a CNN).
    Raises:
      ValueError: a missing array, mismatched lengths, or labels that are not 0..C−1 integers,
        naming the file.
    """
    with np.load(path, allow_pickle=False) as f:
        missing = [k for k in ("x", "y") if k not in f.files]
        if missing:
            raise ValueError(f"data.path: {path} has no array {missing[0]!r}; it holds "
                             f"{sorted(f.files)} (save it with np.savez(path, x=..., y=...))")
        x, y = np.asarray(f["x"]), np.asarray(f["y"])
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"data.path: {path}: x has {len(x)} examples and y {len(y)}; they must "
                         "match (at least 2)")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1 or y.min() < 0:
        raise ValueError(f"data.path: {path}: y must be integer class labels 0..C-1 of shape "
                         f"(n,), got {y.dtype} {y.shape}")
    x = x.astype(np.float64)
    tr, te = train_test_split(len(y), test_fraction, seed)
    if standardize:
        mean = x[tr].mean(axis=0)
        std = x[tr].std(axis=0)
        x = (x - mean) / np.maximum(std, 1e-6 * max(float(std.max()), 1e-12))
    x = x.astype(np.float32)
    if flatten:
        x = x.reshape(len(x), -1)
    info = {"in_dim": int(np.prod(x.shape[1:])), "num_classes": int(y.max()) + 1,
            "num_train": len(tr), "num_test": len(te)}
    y = y.astype(np.int32)
    return Dataset({"x": x[tr], "y": y[tr]}, {"x": x[te], "y": y[te]}, info)
