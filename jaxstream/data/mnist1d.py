"""MNIST-1D (Greydanus, 2020): 1-D digit templates, generated locally by the ``mnist1d`` package.

The package's ``make_dataset`` builds the data from ten hand-written 1-D templates with seeded
random padding, scaling, translation, shear and noise; nothing is downloaded (the package's own
``get_dataset`` would fetch a pickle from the web, so it is never called). The default arguments
(4000 train / 1000 test sequences of length 40, seed 42) are the published benchmark, whose
baselines are 32 % (logistic regression), 68 % (MLP) and 94 % (CNN) test accuracy.

Generation takes a few seconds, so the arrays are cached as ``.npz`` in ``cache_dir`` (default:
``$JAXSTREAM_CACHE`` or ``~/.cache/jaxstream``), keyed by the generation arguments.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from jaxstream.data.digits import Dataset

SEQ_LEN, NUM_CLASSES = 40, 10


def default_cache_dir() -> Path:
    """``$JAXSTREAM_CACHE`` if set, else ``~/.cache/jaxstream``."""
    return Path(os.environ.get("JAXSTREAM_CACHE", Path.home() / ".cache" / "jaxstream"))


def _generate(num_samples: int, train_split: float, seed: int) -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.train_split, args.seed = num_samples, train_split, seed
    state = np.random.get_state()  # make_dataset seeds NumPy's global generator: restore it
    try:
        raw = make_dataset(args)
    finally:
        np.random.set_state(state)
    return {"x": raw["x"], "y": raw["y"], "x_test": raw["x_test"], "y_test": raw["y_test"]}


def load_mnist1d(seed: int = 42, num_samples: int = 5000, train_split: float = 0.8,
                 cache_dir: str | Path | None = None) -> Dataset:
    """MNIST-1D as a :class:`Dataset` (x float32 (n, 40), y int32), generated or read from cache.

    Args:
      seed: generation seed (42 is the published data set).
      num_samples: train + test sequences (5000 published).
      train_split: share used for training (0.8 published).
      cache_dir: where the ``.npz`` cache lives (None: :func:`default_cache_dir`).

    Example:
      >>> ds = load_mnist1d()
      >>> ds.train["x"].shape, ds.test["x"].shape
      ((4000, 40), (1000, 40))
    """
    if num_samples < 20:
        raise ValueError(f"num_samples: must be >= 20, got {num_samples}")
    if not 0.0 < train_split < 1.0:
        raise ValueError(f"train_split: must be in (0, 1), got {train_split}")
    tag = json.dumps([seed, num_samples, train_split])
    name = f"mnist1d-{hashlib.sha1(tag.encode()).hexdigest()[:12]}.npz"
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = path / name
    if file.exists():
        with np.load(file) as z:
            raw = {k: z[k] for k in z.files}
    else:
        raw = _generate(num_samples, train_split, seed)
        path.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **raw)
        os.replace(tmp, file)  # atomic: concurrent loaders never read a half-written cache
    train = {"x": raw["x"].astype(np.float32), "y": raw["y"].astype(np.int32)}
    test = {"x": raw["x_test"].astype(np.float32), "y": raw["y_test"].astype(np.int32)}
    info = {"in_dim": SEQ_LEN, "num_classes": NUM_CLASSES, "num_train": len(train["y"]),
            "num_test": len(test["y"])}
    return Dataset(train, test, info)
