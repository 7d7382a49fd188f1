"""Standard-library text corpus: fixed files, split by file, windows shifted by one."""

from __future__ import annotations

import numpy as np
import pytest

from jaxstream.data import load_text
from jaxstream.data.text import (
    TEST_FILES,
    TRAIN_FILES,
    VOCAB_SIZE,
    corpus,
    decode,
    encode,
    stdlib_dir,
)


def test_encode_decode_and_vocab():
    s = "def f(x):\n\treturn x + 1  # ok"
    ids = encode(s)
    assert ids.dtype == np.int32 and ids.max() < VOCAB_SIZE
    assert decode(ids) == s.replace("\t", " ")
    assert decode(encode("é")) == "?"


def test_windows_come_from_their_split():
    assert not set(TRAIN_FILES) & set(TEST_FILES)
    ds = load_text(seed=1, seq_len=16, num_train=8, num_test=4)
    assert ds.train["x"].shape == (8, 16) and ds.info["vocab_size"] == VOCAB_SIZE
    np.testing.assert_array_equal(ds.train["x"][:, 1:], ds.train["y"][:, :-1])
    train_text = decode(corpus(TRAIN_FILES))
    test_text = decode(corpus(TEST_FILES))
    for x, y in zip(ds.test["x"], ds.test["y"]):
        window = decode(np.concatenate([x, y[-1:]]))
        assert window in test_text
    for x in ds.train["x"]:
        assert decode(x) in train_text
    again = load_text(seed=1, seq_len=16, num_train=8, num_test=4)
    np.testing.assert_array_equal(again.test["y"], ds.test["y"])
    assert (stdlib_dir() / TRAIN_FILES[0]).is_file()


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="seq_len"):
        load_text(seq_len=0)
    with pytest.raises(FileNotFoundError, match="argparse.py"):
        load_text(seq_len=8, num_train=2, num_test=2, root=tmp_path)
