"""Ring all-reduce: reduce-scatter then all-gather, chunks passed a->b->c->d->a by ppermute.

Every device sends 2(n-1)/n of the payload, whatever n is; this is what NCCL does on a ring,
written out with ``jax.lax.ppermute`` so it can be studied next to XLA's ``psum``.  Call these
functions *inside* ``shard_map`` over the axis named ``axis_name``.  Any length works: the flat
vector is zero-padded to a multiple of the device count.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["ring_all_reduce", "ring_all_reduce_tree", "ring_chunk_size", "ring_wire_bytes"]


def ring_chunk_size(length: int, num_devices: int) -> int:
    """Elements per chunk once ``length`` is padded to a multiple of ``num_devices``."""
    return max(1, math.ceil(length / num_devices))


def ring_wire_bytes(length: int, num_devices: int, itemsize: int) -> int:
    """Bytes each device sends in one ring all-reduce of ``length`` elements.

    2(n-1) sends of one (padded) chunk each; 0 on one device.
    """
    return 2 * (num_devices - 1) * ring_chunk_size(length, num_devices) * itemsize


def _shift(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    """Send ``x`` to the next device on the ring: i -> i+1 (mod n)."""
    return jax.lax.ppermute(x, axis_name, [(i, (i + 1) % n) for i in range(n)])


def ring_all_reduce(x: jax.Array, axis_name: str, *, mean: bool = False) -> jax.Array:
    """Sum (or mean) of ``x`` over ``axis_name`` by an explicit ring; same result as ``psum``.

    Args:
      x: this device's array, any shape.
      axis_name: the mesh axis to reduce over (e.g. ``"data"``).
      mean: divide by the number of devices.

    Returns:
      An array of ``x``'s shape, identical on every device; ``x``'s dtype, or for the mean of
      an integer array the float dtype ``lax.pmean`` gives (on any number of devices).

    Example:
      >>> f = shard_map(lambda x: ring_all_reduce(x, "data"), mesh=mesh,
      ...               in_specs=P("data"), out_specs=P())
    """
    n = jax.lax.axis_size(axis_name)
    if n == 1:
        return x / n if mean else x  # the dtype a mean has on more devices
    flat = x.reshape(-1)
    size = flat.shape[0]
    chunk = ring_chunk_size(size, n)
    chunks = jnp.pad(flat, (0, chunk * n - size)).reshape(n, chunk)
    me = jax.lax.axis_index(axis_name)

    # Reduce-scatter: at step k device i sends its partial sum of chunk (i - k) mod n to i+1,
    # which adds it to its own copy.  After n-1 steps device i owns chunk (i + 1) mod n.
    for k in range(n - 1):
        send = jax.lax.dynamic_index_in_dim(chunks, (me - k) % n, keepdims=False)
        recv = _shift(send, axis_name, n)
        idx = (me - k - 1) % n
        cur = jax.lax.dynamic_index_in_dim(chunks, idx, keepdims=False)
        chunks = jax.lax.dynamic_update_index_in_dim(chunks, cur + recv, idx, 0)

    # All-gather: pass the finished chunks on around the ring, overwriting stale copies.
    for k in range(n - 1):
        send = jax.lax.dynamic_index_in_dim(chunks, (me + 1 - k) % n, keepdims=False)
        recv = _shift(send, axis_name, n)
        chunks = jax.lax.dynamic_update_index_in_dim(chunks, recv, (me - k) % n, 0)

    out = chunks.reshape(-1)[:size].reshape(x.shape)
    return out / n if mean else out


def ring_all_reduce_tree(tree, axis_name: str, *, mean: bool = False):
    """Ring all-reduce of a pytree as one flat bucket (one ring pass for all leaves).

    Leaves are cast to their common result dtype, concatenated, reduced, split back and
    cast to their own dtype.

    Args:
      tree: pytree of this device's arrays.
      axis_name: mesh axis to reduce over.
      mean: divide by the number of devices.

    Returns:
      The reduced pytree, same structure, shapes and dtypes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    dtype = jnp.result_type(*leaves)
    flat = jnp.concatenate([jnp.ravel(leaf).astype(dtype) for leaf in leaves])
    flat = ring_all_reduce(flat, axis_name, mean=mean)
    out, start = [], 0
    for leaf in leaves:
        out.append(flat[start : start + leaf.size].reshape(leaf.shape).astype(leaf.dtype))
        start += leaf.size
    return jax.tree.unflatten(treedef, out)
