"""Compressed codecs for symmetric matrices: packed lower triangle, or Cholesky factor.

A d x d symmetric matrix (a Gram or second-moment statistic, a Shampoo-style
preconditioner) is determined by d(d+1)/2 numbers.  ``packed`` sends the lower triangle
(exact; linear, so it can be summed by ``psum`` in packed form).  ``cholesky`` sends the
packed factor L of a positive-definite D = L L^T; the receiver rebuilds a matrix that is
positive definite by construction, even after rounding or a lower-precision transfer.  The
factor is not linear in D, so summing factored matrices needs an all-gather of the factors
(see :mod:`jaxstream.comm.symmetric_reduce`).

Validation (square, symmetric, positive definite) runs on the host, on concrete input,
before any compute; inside ``jit`` only the shape is checked.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CODECS",
    "Codec",
    "cholesky_decode",
    "cholesky_encode",
    "decode",
    "encode",
    "pack_lower",
    "packed_size",
    "unpack_lower",
    "validate_symmetric",
]  # fmt: skip

Codec = Literal["dense", "packed", "cholesky"]
CODECS: tuple[str, ...] = ("dense", "packed", "cholesky")


def packed_size(d: int) -> int:
    """Numbers sent for one d x d symmetric matrix: d(d+1)/2."""
    return d * (d + 1) // 2


def _concrete(x) -> np.ndarray | None:
    """The value of ``x`` as NumPy, or None if ``x`` is traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_square(shape: tuple[int, ...], name: str) -> int:
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"{name} must have shape (..., d, d); got {tuple(shape)}")
    return shape[-1]


def validate_symmetric(
    mat, name: str = "matrix", *, positive_definite: bool = False, rtol: float = 1e-5
) -> None:
    """Raise ``ValueError`` unless ``mat`` (..., d, d) is symmetric (and PD if asked).

    Args:
      mat: concrete array; traced input is only shape-checked.
      name: name used in the message.
      positive_definite: also require every matrix to be positive definite.
      rtol: symmetry tolerance relative to the largest entry.
    """
    _check_square(tuple(np.shape(mat)), name)
    value = _concrete(mat)
    if value is None:
        return
    value = value.astype(np.float64)
    if not np.all(np.isfinite(value)):
        raise ValueError(f"{name} has non-finite entries")
    gap = np.max(np.abs(value - np.swapaxes(value, -1, -2)), initial=0.0)
    scale = max(np.max(np.abs(value), initial=0.0), np.finfo(np.float32).tiny)
    if gap > rtol * scale:
        raise ValueError(
            f"{name} is not symmetric: max |A - A^T| = {gap:.3g} > {rtol:g} x max |A| "
            f"= {rtol * scale:.3g}; the symmetric codecs ('packed', 'cholesky') send only "
            "the lower triangle"
        )
    if positive_definite:
        low = float(np.min(np.linalg.eigvalsh(value)))
        if not low > 0:
            raise ValueError(
                f"{name} is not positive definite (smallest eigenvalue {low:.3g}); "
                "codec='cholesky' needs D = L L^T with D positive definite; use codec='packed'"
            )


def pack_lower(mat: jax.Array, *, check: bool = True) -> jax.Array:
    """Lower triangle (row-major, diagonal included) of (..., d, d) -> (..., d(d+1)/2)."""
    d = _check_square(mat.shape, "matrix")
    if check:
        validate_symmetric(mat)
    rows, cols = np.tril_indices(d)
    return mat[..., rows, cols]


def unpack_lower(vec: jax.Array, d: int, *, symmetric: bool = True) -> jax.Array:
    """Inverse of :func:`pack_lower`: (..., d(d+1)/2) -> (..., d, d).

    ``symmetric=False`` leaves the upper triangle zero (a triangular factor).
    """
    if vec.shape[-1] != packed_size(d):
        raise ValueError(f"packed vector has {vec.shape[-1]} entries; d={d} needs {packed_size(d)}")
    rows, cols = np.tril_indices(d)
    low = jnp.zeros((*vec.shape[:-1], d, d), vec.dtype).at[..., rows, cols].set(vec)
    if not symmetric:
        return low
    diag = (
        jnp.zeros_like(low)
        .at[..., np.arange(d), np.arange(d)]
        .set(low[..., np.arange(d), np.arange(d)])
    )
    return low + jnp.swapaxes(low, -1, -2) - diag


def cholesky_encode(mat: jax.Array, *, check: bool = True) -> jax.Array:
    """Packed Cholesky factor L of a positive-definite (..., d, d) matrix, D = L L^T."""
    _check_square(mat.shape, "matrix")
    if check:
        validate_symmetric(mat, positive_definite=True)
    return pack_lower(jnp.linalg.cholesky(mat), check=False)


def cholesky_decode(vec: jax.Array, d: int) -> jax.Array:
    """Rebuild D = L L^T from a packed factor (positive semi-definite by construction)."""
    low = unpack_lower(vec, d, symmetric=False)
    return low @ jnp.swapaxes(low, -1, -2)


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"codec must be one of {CODECS}; got {codec!r}")


def encode(mat: jax.Array, codec: Codec, *, check: bool = True) -> jax.Array:
    """Encode (..., d, d) with ``codec`` ('dense' returns ``mat`` unchanged)."""
    _check_codec(codec)
    if codec == "packed":
        return pack_lower(mat, check=check)
    if codec == "cholesky":
        return cholesky_encode(mat, check=check)
    return mat


def decode(payload: jax.Array, codec: Codec, d: int) -> jax.Array:
    """Inverse of :func:`encode`."""
    _check_codec(codec)
    if codec == "packed":
        return unpack_lower(payload, d)
    if codec == "cholesky":
        return cholesky_decode(payload, d)
    return payload
