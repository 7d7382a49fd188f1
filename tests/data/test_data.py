"""Digits split and standardisation, seeded batches, synthetic character corpus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxstream.data import batch_at, batch_indices, load_chars, load_digits


def test_digits_split_is_deterministic_and_disjoint():
    a, b = load_digits(seed=3), load_digits(seed=3)
    np.testing.assert_array_equal(a.train["x"], b.train["x"])
    np.testing.assert_array_equal(a.test["y"], b.test["y"])
    c = load_digits(seed=4)
    assert not np.array_equal(a.test["y"], c.test["y"])
    assert len(a.train["y"]) + len(a.test["y"]) == 1797
    assert a.train["x"].dtype == np.float32 and a.train["y"].dtype == np.int32
    # No test row appears in the train set.
    train_rows = {r.tobytes() for r in a.train["x"]}
    dup = sum(r.tobytes() in train_rows for r in a.test["x"])
    assert dup <= 2  # digits itself holds a couple of identical images


def test_digits_standardised_with_train_statistics():
    from sklearn.datasets import load_digits as raw_digits

    ds = load_digits(seed=0)
    x = ds.train["x"].astype(np.float64)
    np.testing.assert_allclose(x.mean(0), 0.0, atol=1e-5)
    raw = raw_digits().data
    std = raw.std(0)
    varying = std > 2.0  # pixels whose train std is surely above the 1.0 floor
    np.testing.assert_allclose(x.std(0)[varying], 1.0, rtol=1e-4)
    assert load_digits(images=True).train["x"].shape[1:] == (8, 8, 1)


def test_batches_are_a_function_of_seed_and_step():
    n, bs = 50, 16
    np.testing.assert_array_equal(batch_indices(n, bs, 1, 7), batch_indices(n, bs, 1, 7))
    assert not np.array_equal(batch_indices(n, bs, 1, 7), batch_indices(n, bs, 2, 7))
    # Consecutive batches walk through epoch-wise permutations: each epoch sees every example once.
    pos = np.concatenate([batch_indices(n, bs, 1, s) for s in range(25)])  # 400 = 8 epochs
    for e in range(8):
        assert sorted(pos[e * n:(e + 1) * n]) == list(range(n))
    data = {"x": np.arange(n)[:, None] * 1.0, "y": np.arange(n)}
    b = batch_at(data, bs, 1, 3)
    np.testing.assert_array_equal(b["y"], batch_indices(n, bs, 1, 3))
    with pytest.raises(ValueError, match="batch_size"):
        batch_indices(n, 0, 1, 0)


def test_chars_targets_are_next_characters():
    ds = load_chars(seed=0, seq_len=16, num_train=32, num_test=8)
    assert ds.train["x"].shape == (32, 16) and ds.test["y"].shape == (8, 16)
    np.testing.assert_array_equal(ds.train["x"][:, 1:], ds.train["y"][:, :-1])
    assert ds.train["x"].max() < ds.info["vocab_size"]
    again = load_chars(seed=0, seq_len=16, num_train=32, num_test=8)
    np.testing.assert_array_equal(ds.train["x"], again.train["x"])


def test_a_batch_larger_than_the_data_set_is_refused_by_name():
    """An epoch-wise batch larger than the data set would hold examples twice: refused, naming
    the field and the allowed range (a batch the size of the data set is one whole epoch)."""
    import re

    from jaxstream.data.batches import batch_indices

    with pytest.raises(ValueError, match=re.escape("batch_size: 11 exceeds the 10 examples")):
        batch_indices(10, 11, seed=0, step=0)
    assert sorted(batch_indices(10, 10, seed=0, step=3)) == list(range(10))


def test_a_users_npz_arrays_are_split_and_standardised(tmp_path):
    """An .npz of the user's own images: split by the seed like the digits, standardised with
    the train statistics (checked in float64 by hand), labels kept; bad files name the field."""
    from jaxstream.data.arrays import load_npz
    from jaxstream.data.digits import train_test_split

    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, (50, 4, 4)).astype(np.float32)
    y = rng.integers(0, 3, 50)
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    ds = load_npz(tmp_path / "mine.npz", seed=5, test_fraction=0.2)
    tr, te = train_test_split(50, 0.2, 5)
    flat = x.reshape(50, -1).astype(np.float64)
    want = (flat - flat[tr].mean(0)) / flat[tr].std(0)
    np.testing.assert_allclose(ds.train["x"], want[tr], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ds.test["x"], want[te], rtol=1e-5, atol=1e-5)
    assert (ds.train["y"] == y[tr]).all() and ds.train["y"].dtype == np.int32
    assert ds.info == {"in_dim": 16, "num_classes": 3, "num_train": 40, "num_test": 10}
    assert load_npz(tmp_path / "mine.npz", flatten=False).train["x"].shape[1:] == (4, 4)
    np.savez(tmp_path / "bad.npz", x=x, labels=y)
    with pytest.raises(ValueError, match=r"data.path: .*bad.npz has no array 'y'"):
        load_npz(tmp_path / "bad.npz")
    np.savez(tmp_path / "float.npz", x=x, y=y.astype(np.float32))
    with pytest.raises(ValueError, match="y must be integer class labels"):
        load_npz(tmp_path / "float.npz")


def test_a_run_trains_on_npz_arrays(tmp_path):
    from sklearn.datasets import load_digits as sk

    from jaxstream.experiment.runner import run_experiment

    raw = sk()
    np.savez(tmp_path / "digits.npz", x=raw.data, y=raw.target)
    quick = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"
    _, summary = run_experiment(quick, [
        f"data={{type: npz, path: {tmp_path / 'digits.npz'}}}", "steps=20", "eval_every=10",
        "diag_every=0", "batch_size=32", "plots=false", "progress=false",
        "arms=[{name: bp, estimator: {type: backprop}, lr: 0.01}]"], out=tmp_path / "run")
    assert summary["arms"]["bp"]["final_test_accuracy"] > 0.5  # 20 steps on digits: learning
