"""A tiny synthetic character corpus for the character transformer (generated, no download).

Text is a seeded stream of words from a small vocabulary that follow a first-order Markov chain
over words, so next-character prediction has learnable structure: within a word it is nearly
deterministic, at word boundaries it depends on the previous word.
"""

from __future__ import annotations

import numpy as np

from jaxstream.data.digits import Dataset

ALPHABET = " abcdefghijklmnopqrstuvwxyz"


def synthetic_text(num_chars: int, seed: int = 0, num_words: int = 24) -> str:
    """``num_chars`` characters of seeded pseudo-text over :data:`ALPHABET`."""
    rng = np.random.default_rng([seed, 7])
    letters = np.array(list(ALPHABET[1:]))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 7))) for _ in range(num_words)]
    # Each word has 3 likely successors.
    succ = rng.integers(0, num_words, size=(num_words, 3))
    out, total, w = [], 0, 0
    while total < num_chars:
        w = int(succ[w, rng.integers(0, 3)]) if rng.random() < 0.9 else int(rng.integers(num_words))
        out.append(words[w])
        total += len(words[w]) + 1
    return " ".join(out)[:num_chars]


def encode(text: str) -> np.ndarray:
    """Character ids (int32) of ``text`` over :data:`ALPHABET`."""
    table = {c: i for i, c in enumerate(ALPHABET)}
    return np.array([table[c] for c in text], dtype=np.int32)


def load_chars(seed: int = 0, seq_len: int = 32, num_train: int = 2048, num_test: int = 256,
               num_words: int = 24) -> Dataset:
    """Windows of a synthetic corpus: x = chars[t:t+T], y = chars[t+1:t+T+1] (int32, (n, T)).

    Train and test windows come from disjoint parts of the text.

    Example:
      >>> ds = load_chars(seq_len=16, num_train=64, num_test=16)
      >>> ds.train["x"].shape, ds.info["vocab_size"]
      ((64, 16), 27)
    """
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")

    def windows(ids: np.ndarray, n: int, rng: np.random.Generator) -> dict:
        starts = rng.integers(0, len(ids) - seq_len - 1, size=n)
        idx = starts[:, None] + np.arange(seq_len)[None]
        return {"x": ids[idx], "y": ids[idx + 1]}

    n_chars = 8 * seq_len + 4 * (num_train + num_test)
    ids = encode(synthetic_text(n_chars, seed, num_words))
    cut = int(len(ids) * num_train / (num_train + num_test))
    rng = np.random.default_rng([seed, 11])
    train = windows(ids[:cut], num_train, rng)
    test = windows(ids[cut:], num_test, rng)
    info = {"vocab_size": len(ALPHABET), "seq_len": seq_len, "num_classes": len(ALPHABET),
            "num_train": num_train, "num_test": num_test}
    return Dataset(train, test, info)
