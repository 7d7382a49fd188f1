"""Symmetric codecs: exact packed form, Cholesky within 1e-5, bytes, clear errors."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxstream.comm import (
    all_reduce_symmetric,
    cholesky_decode,
    cholesky_encode,
    pack_lower,
    packed_size,
    send_symmetric,
    symmetric_traffic,
    unpack_lower,
)

D = 24


def _grams(n, d=D, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, d, 3 * d)).astype(np.float32)
    g = x @ np.swapaxes(x, 1, 2) / (3 * d) + 0.1 * np.eye(d, dtype=np.float32)
    return (g + np.swapaxes(g, 1, 2)) / 2


def _mesh(n=8):
    return Mesh(np.array(jax.devices()[:n]), ("data",))


def test_packed_roundtrip_is_exact():
    m = _grams(3)
    vec = pack_lower(m)
    assert vec.shape == (3, packed_size(D))
    np.testing.assert_array_equal(np.asarray(unpack_lower(vec, D)), m)


def test_cholesky_roundtrip_within_1e5():
    m = _grams(3)
    rebuilt = np.asarray(cholesky_decode(cholesky_encode(m), D))
    rel = np.max(np.abs(rebuilt - m)) / np.max(np.abs(m))
    assert rel < 1e-5


@pytest.mark.parametrize("codec", ["dense", "packed", "cholesky"])
def test_all_reduce_symmetric_equals_sum(codec):
    m = _grams(8)
    out = np.asarray(all_reduce_symmetric(m, _mesh(), codec=codec))
    expected = m.astype(np.float64).sum(0)
    assert np.max(np.abs(out - expected)) / np.max(np.abs(expected)) < 1e-5
    if codec == "packed":
        np.testing.assert_allclose(out, out.T, rtol=0, atol=0)


@pytest.mark.parametrize("codec", ["packed", "cholesky"])
def test_send_symmetric_shifts_ring(codec):
    m = _grams(4)
    out = np.asarray(send_symmetric(m, _mesh(4), codec=codec))
    np.testing.assert_allclose(out, np.roll(m, 1, axis=0), rtol=1e-5, atol=1e-5)


def test_bytes_counted_and_ratio():
    m = _grams(8)
    mesh = _mesh()
    dense = symmetric_traffic(m, mesh, codec="dense")
    packed = symmetric_traffic(m, mesh, codec="packed")
    assert dense["all-reduce"] == D * D * 4
    assert packed["all-reduce"] == packed_size(D) * 4
    assert packed["sent_bytes"] / dense["sent_bytes"] <= 0.55
    chol_send = symmetric_traffic(m, mesh, codec="cholesky", op="send")
    dense_send = symmetric_traffic(m, mesh, codec="dense", op="send")
    assert chol_send["sent_bytes"] / dense_send["sent_bytes"] <= 0.55


def test_packed_rejects_non_symmetric():
    m = _grams(8)
    m[3, 0, 1] += 1.0
    with pytest.raises(ValueError, match="not symmetric"):
        all_reduce_symmetric(m, _mesh(), codec="packed")
    with pytest.raises(ValueError, match="not symmetric"):
        pack_lower(m[3])


def test_cholesky_rejects_non_positive_definite():
    m = _grams(8)
    m[2] -= 10.0 * np.eye(D, dtype=np.float32)
    with pytest.raises(ValueError, match="not positive definite"):
        all_reduce_symmetric(m, _mesh(), codec="cholesky")
    with pytest.raises(ValueError, match="not positive definite"):
        cholesky_encode(m[2])
    all_reduce_symmetric(m[:8], _mesh(), codec="packed")  # symmetric: packed is fine


def test_bad_codec_and_shape():
    m = _grams(8)
    with pytest.raises(ValueError, match="codec must be one of"):
        all_reduce_symmetric(m, _mesh(), codec="zip")
    with pytest.raises(ValueError, match="one matrix per device"):
        all_reduce_symmetric(m[:4], _mesh(), codec="packed")
    with pytest.raises(ValueError, match=r"shape \(\.\.\., d, d\)"):
        pack_lower(np.zeros((3, 4), np.float32))
