"""``jax.random.bits``, bit for bit, in a form that keeps XLA's temporary memory at that of
the consumer.

On CPU, ``jax.random`` hashes with Threefry-2x32 in a rolled loop: every call is a ``while`` whose
state starts as copies of constants (rotations, a counter) that XLA schedules at the start of the
program and keeps until the loop runs, and whose counters (an iota as large as the output) XLA
hoists out of a scan over layers and keeps through it. Here:

* :func:`random_words` hashes, on CPU, all 20 rounds in one pass over the words: the body of a
  loop that runs once (a loop, so that XLA materialises the words once; hashed elementwise
  inside their consumer they would be rehashed for each of the 32 signs a word gives). The
  loop's state and bounds (counters, start index) are derived from the key: computed where
  the words are drawn, not hoisted or copied ahead of time. ``jax.random``'s loop of 5 × 4
  rounds passes over the words five times, this one once (the words are the same). Other
  platforms, and draws below ``MIN_WORDS`` (a few KiB, where the loop's compile time costs
  more than its buffers), use ``jax.random.bits``. The key schedule's ``fold_in`` stays
  ``jax.random.fold_in``: written out as scalar rounds it saved about 4 KiB of loop
  constants and doubled compile times.
* :func:`random_normal` is ``jax.random.normal`` (float32) drawn from those words, op for op
  (Gaussian tangents). ``python benchmarks/draws.py`` times both draws against ``jax.random``'s.

Keys of another implementation, raw ``uint32`` keys or ``jax_threefry_partitionable=False`` use
``jax.random`` directly; :func:`vmap_exact` makes draws with ``rbg`` keys the same under
``jax.vmap`` over keys as in a loop (threefry draws already are).

Example:
  >>> k = jax.random.key(0)
  >>> bool((random_words(k, (2, 5)) == jax.random.bits(k, (2, 5), jnp.uint32)).all())
  True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
# Below this many words a draw uses ``jax.random.bits``: its buffers are a few KiB, and the
# hashing loop costs compile time (every draw is a loop of its own).
MIN_WORDS = 4096


def _is_threefry(key: jax.Array) -> bool:
    return (jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
            and str(jax.random.key_impl(key)) == "threefry2x32"
            and bool(jax.config.jax_threefry_partitionable))


def _hashed_here(key: jax.Array, size: int) -> bool:
    """Whether a draw of ``size`` words with ``key`` is hashed here (else by ``jax.random``)."""
    return _is_threefry(key) and MIN_WORDS <= size < 2**32


def random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.bits(key, shape, jnp.uint32)``, bit for bit (one key, a static shape)."""
    size = math.prod(shape)
    if not _hashed_here(key, size):
        return jax.random.bits(key, shape, dtype=jnp.uint32)
    k = jax.random.key_data(key)
    zero = opaque_zero(k)
    # counters 0 … size-1 (their high words are 0), derived from the key so that they are
    # computed where the words are drawn, not hoisted out of a loop over layers.
    lo = jax.lax.iota(jnp.uint32, size).reshape(shape) + zero
    hi = jnp.broadcast_to(zero, shape)
    return jax.lax.platform_dependent(
        cpu=lambda: _one_pass_words(k[0], k[1], hi, lo, zero),
        default=lambda: jax.random.bits(key, shape, jnp.uint32))


def random_normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.normal(key, shape, jnp.float32)``, bit for bit, its words from
    :func:`random_words` (the same uniform from the words' top 23 bits, the same inverse
    error function); other keys, other sizes and other platforms as :func:`random_words`."""
    if not _hashed_here(key, math.prod(shape)):
        return jax.random.normal(key, shape, jnp.float32)
    # jax.random.uniform's open interval (nextafter(-1, 0), 1) and its arithmetic, op for op
    lo = jnp.float32(np.nextafter(np.float32(-1.0), np.float32(0.0)))
    hi = jnp.float32(1.0)
    mantissa = jax.lax.shift_right_logical(random_words(key, shape), jnp.uint32(32 - 23))
    floats = jax.lax.bitcast_convert_type(mantissa | jnp.uint32(0x3F800000), jnp.float32) \
        - jnp.float32(1.0)
    u = jax.lax.max(lo, floats * (hi - lo) + lo)
    return jnp.float32(np.sqrt(2)) * jax.lax.erf_inv(u)


def _one_pass_words(k1, k2, x1, x2, zero):
    """Threefry-2x32 (20 rounds) in one pass over the words: the body of a loop that runs
    once, whose state and bounds are derived from the key (nothing is copied into the loop's
    state ahead of time, and XLA can neither drop the loop nor fuse the hash into the words'
    consumer); the rotations are constants of its body."""
    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(0x1BD11BDA))

    def body(_, x):
        x1, x2 = x0 = x
        for i in range(5):
            for r in _ROTATIONS[i % 2]:
                x1 = x1 + x2
                x2 = ((x2 << jnp.uint32(r)) | (x2 >> jnp.uint32(32 - r))) ^ x1
            x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
        return x1 ^ x2, x0[1]  # the second word passes through: one array written, not two

    start = zero.astype(jnp.int32)
    return jax.lax.fori_loop(start, start + 1, body, (x1 + ks[0], x2 + ks[1]))[0]


def opaque_zero(x: jax.Array) -> jax.Array:
    """A ``uint32`` 0 computed from ``x``'s first element (two shifts XLA does not fold)."""
    first = jnp.ravel(x)[0]
    if jnp.issubdtype(first.dtype, jax.dtypes.prng_key):
        first = jax.random.key_data(first).ravel()[0]
    bits = jax.lax.bitcast_convert_type(first.astype(jnp.float32), jnp.uint32) \
        if jnp.issubdtype(first.dtype, jnp.floating) else first.astype(jnp.uint32)
    return (bits >> jnp.uint32(16)) >> jnp.uint32(16)


def tied(tree, x: jax.Array):
    """``tree`` unchanged in value, its integer leaves and keys made to depend on ``x``: XLA
    then computes what they feed after ``x`` instead of ahead of time (where it would hold the
    result through everything in between).

    Example:
      >>> tied(jnp.arange(3), jnp.float32(1.5)).tolist()   # the same values, computed after x
      [0, 1, 2]
    """
    zero = opaque_zero(x)

    def tie(a):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(a)
            return jax.random.wrap_key_data(data + zero, impl=jax.random.key_impl(a))
        if jnp.issubdtype(a.dtype, jnp.integer):
            return a + zero.astype(a.dtype)
        return a

    return jax.tree.map(tie, tree)


def vmap_exact(draw: Callable[[jax.Array], jax.Array], key: jax.Array) -> jax.Array:
    """``draw(key)``, with the same values whether or not it is vmapped over keys.

    Threefry draws already are. ``rbg`` / ``unsafe_rbg`` draws under ``jax.vmap`` over keys
    depend on the batch position (row i ≥ 1 differs from the unbatched draw of key i), so an
    engine that vmaps over micro-batch keys and one that loops would get different tangents, and
    a pass that draws under vmap and a combine that draws in a loop would disagree. For those
    keys the vmapped draw runs row by row (``lax.map``).

    Example:
      >>> ks = jax.random.split(jax.random.key(0, impl="rbg"), 2)
      >>> draw = lambda k: jax.random.bits(k, (3,))
      >>> rows = jax.vmap(lambda k: vmap_exact(draw, k))(ks)
      >>> bool((rows[1] == draw(ks[1])).all())
      True
    """
    if _is_threefry(key) or not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return draw(key)
    impl = str(jax.random.key_impl(key))

    @jax.custom_batching.custom_vmap
    def one(kd):
        return draw(jax.random.wrap_key_data(kd, impl=impl))

    @one.def_vmap
    def _rows(axis_size, in_batched, kd):
        if not in_batched[0]:
            return one(kd), False
        return jax.lax.map(one, kd), True

    return one(jax.random.key_data(key))
