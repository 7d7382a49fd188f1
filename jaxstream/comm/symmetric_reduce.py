"""Move symmetric matrices between devices in compressed form, and count the bytes.

``all_reduce_symmetric`` sums one matrix per device over a mesh axis:
  - ``dense``: ``psum`` of d x d numbers;
  - ``packed``: ``psum`` of the packed lower triangle (d(d+1)/2 numbers, exact);
  - ``cholesky``: the factor is not linear in D, so the packed factors are all-gathered and
    every device rebuilds and sums L_i L_i^T (n x d(d+1)/2 numbers received; the sum is
    positive definite by construction).
``send_symmetric`` passes each device's matrix to the next on the ring (one ``ppermute``):
the point-to-point case, where both codecs send d(d+1)/2 numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxstream.comm.symmetric import Codec, _check_codec, decode, encode, validate_symmetric
from jaxstream.comm.traffic import collectives, traffic_summary

__all__ = ["all_reduce_symmetric", "send_symmetric", "symmetric_traffic"]


def _check_input(mats, mesh: Mesh, codec: str, axis: str) -> int:
    _check_codec(codec)
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not a mesh axis; mesh axes are {mesh.axis_names}")
    n = mesh.shape[axis]
    if np.ndim(mats) != 3 or np.shape(mats)[0] != n:
        raise ValueError(
            f"mats must have shape ({n}, d, d), one matrix per device on axis {axis!r}; "
            f"got {np.shape(mats)}"
        )
    if codec != "dense":
        validate_symmetric(mats, "mats", positive_definite=codec == "cholesky")
    return np.shape(mats)[-1]


@functools.lru_cache(maxsize=64)
def _build(mesh: Mesh, codec: str, op: str, axis: str, d: int):
    n = mesh.shape[axis]

    def reduce(mat):
        payload = encode(mat[0], codec, check=False)
        if codec == "cholesky":
            gathered = jax.lax.all_gather(payload, axis)  # (n, d(d+1)/2)
            return jnp.sum(decode(gathered, codec, d), axis=0)[None]
        return decode(jax.lax.psum(payload, axis), codec, d)[None]

    def send(mat):
        payload = encode(mat[0], codec, check=False)
        moved = jax.lax.ppermute(payload, axis, [(i, (i + 1) % n) for i in range(n)])
        return decode(moved, codec, d)[None]

    body = reduce if op == "all_reduce" else send
    return jax.jit(shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def all_reduce_symmetric(mats, mesh: Mesh, *, codec: Codec = "packed", axis: str = "data"):
    """Sum of one symmetric matrix per device, sent in compressed form.

    Args:
      mats: (n, d, d) concrete array, row i on device i of ``axis``.
      mesh: a mesh with axis ``axis`` of size n.
      codec: 'dense' | 'packed' | 'cholesky' (PD input only).
      axis: the mesh axis to reduce over.

    Returns:
      (d, d) sum, identical on every device.

    Raises:
      ValueError: bad codec/shape, a non-symmetric matrix, or (cholesky) a matrix that is
        not positive definite -- checked on the host before anything runs.

    Example:
      >>> total = all_reduce_symmetric(grams, mesh, codec="packed")
    """
    d = _check_input(mats, mesh, codec, axis)
    return _build(mesh, codec, "all_reduce", axis, d)(jnp.asarray(mats))[0]


def send_symmetric(mats, mesh: Mesh, *, codec: Codec = "packed", axis: str = "data"):
    """Pass device i's matrix to device i+1 (mod n) in compressed form; returns (n, d, d)."""
    d = _check_input(mats, mesh, codec, axis)
    return _build(mesh, codec, "send", axis, d)(jnp.asarray(mats))


def symmetric_traffic(
    mats, mesh: Mesh, *, codec: Codec = "packed", op: str = "all_reduce", axis: str = "data"
) -> dict[str, float]:
    """Bytes the compiled ``op`` ('all_reduce' | 'send') passes, read from its HLO.

    Returns :func:`~jaxstream.comm.traffic.traffic_summary` of the compiled function.
    """
    if op not in ("all_reduce", "send"):
        raise ValueError(f"op must be 'all_reduce' or 'send'; got {op!r}")
    d = _check_input(mats, mesh, codec, axis)
    fn = _build(mesh, codec, op, axis, d)
    return traffic_summary(collectives(fn, jnp.asarray(mats), num_devices=mesh.shape[axis]))
