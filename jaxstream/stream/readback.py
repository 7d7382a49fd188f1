"""One device→host transfer for a sweep's scalars (DESIGN §9).

A sweep ends with a few small device values the host needs (losses and directional
derivatives, a selection and its depths, a combine rule's totals and ‖h‖²). Read one by one,
each is a blocking round trip; :func:`read_together` packs them on the device into one flat
uint32 array (a jitted bit-cast, exact for every dtype), reads it once and unpacks it on the
host to the same values and dtypes.

Example::

    losses, d = read_together((losses, d))   # one transfer, NumPy values
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.stream.values import host_value


def _word(a: jax.Array) -> jax.Array:
    """``a`` as a flat uint32 array holding its bits (16- and 8-bit values widened)."""
    size = a.dtype.itemsize
    if a.dtype == jnp.bool_:
        return a.astype(jnp.uint32).ravel()
    if size == 4:
        return jax.lax.bitcast_convert_type(a, jnp.uint32).ravel()
    if size == 8:
        return jax.lax.bitcast_convert_type(a, jnp.uint32).ravel()  # two words a value
    narrow = {2: jnp.uint16, 1: jnp.uint8}[size]
    return jax.lax.bitcast_convert_type(a, narrow).astype(jnp.uint32).ravel()


@jax.jit
def _pack(leaves: list) -> jax.Array:
    return jnp.concatenate([_word(a) for a in leaves]) if leaves else jnp.zeros(0, jnp.uint32)


def _unword(words: np.ndarray, dtype: np.dtype, shape: tuple) -> np.ndarray:
    if dtype == np.bool_:
        return words.astype(np.bool_).reshape(shape)
    if dtype.itemsize >= 4:
        return words.view(dtype).reshape(shape)
    narrow = {2: np.uint16, 1: np.uint8}[dtype.itemsize]
    return words.astype(narrow).view(dtype).reshape(shape)


def read_together(tree: Any) -> Any:
    """NumPy values of a pytree of device arrays, read in one transfer (falls back to
    :func:`~jaxstream.stream.values.host_value`, leaf by leaf, for arrays spread over several
    devices or processes, or held on different devices)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [a for a in leaves if isinstance(a, jax.Array)]
    devices = {d for a in arrays for d in a.devices()}
    if len(devices) != 1 or any(len(a.devices()) != 1 for a in arrays):
        return host_value(tree)
    words = np.asarray(jax.device_get(_pack(arrays)))
    out, at = [], 0
    for a in leaves:
        if not isinstance(a, jax.Array):
            out.append(a)
            continue
        dtype = np.dtype(a.dtype)
        n = int(np.prod(a.shape, dtype=np.int64)) * max(1, dtype.itemsize // 4)
        out.append(_unword(words[at:at + n], dtype, tuple(a.shape)))
        at += n
    return jax.tree.unflatten(treedef, out)

