"""The key schedule's Threefry helpers equal jax.random bit for bit (the engines rely on it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.grad.tangents import TangentSpec
from jaxstream.grad.threefry import MIN_WORDS, random_normal, random_words, tied

KEY = jax.random.fold_in(jax.random.key(3), 5)


@pytest.mark.parametrize("shape", [(3, 5), (1, 16), (2, 3000), (1, MIN_WORDS)])
def test_random_words_equal_jax_bits(shape):  # below MIN_WORDS: jax.random.bits itself
    want = jax.random.bits(KEY, shape, jnp.uint32)
    np.testing.assert_array_equal(jax.jit(random_words, static_argnums=1)(KEY, shape), want)


def test_random_words_under_vmap_and_scan_equal_jax_bits():
    """As the forward pass draws them: vmapped over micro-batch keys (the loop's bounds then
    batched) and in a scan over layers, every row is ``jax.random.bits`` of its own key."""
    keys = jax.random.split(KEY, 3)
    shape = (2, MIN_WORDS)
    rows = jax.jit(jax.vmap(lambda k: random_words(k, shape)))(keys)
    scanned = jax.jit(lambda ks: jax.lax.scan(lambda c, k: (c, random_words(k, shape)), 0, ks)[1])(keys)
    for i in range(3):
        want = jax.random.bits(keys[i], shape, jnp.uint32)
        np.testing.assert_array_equal(rows[i], want)
        np.testing.assert_array_equal(scanned[i], want)


@pytest.mark.parametrize("shape", [(3, 5), (2, 3000), (3, 777, 11)])
def test_random_normal_equals_jax_normal_bit_for_bit(shape):
    """Gaussian tangents: the uniform from the words' top bits and the inverse error function,
    op for op as ``jax.random.normal`` (compared as bits), alone and vmapped over keys."""
    bits = lambda a: np.asarray(a).view(np.uint32)
    want = jax.random.normal(KEY, shape, jnp.float32)
    np.testing.assert_array_equal(bits(jax.jit(random_normal, static_argnums=1)(KEY, shape)),
                                  bits(want))
    keys = jax.random.split(KEY, 2)
    rows = jax.jit(jax.vmap(lambda k: random_normal(k, shape)))(keys)
    for i in range(2):
        np.testing.assert_array_equal(bits(rows[i]), bits(jax.random.normal(keys[i], shape)))


def test_other_impls_fall_back_to_jax_random():
    key = jax.random.key(7, impl="rbg")
    np.testing.assert_array_equal(random_words(key, (2, 4000)), jax.random.bits(key, (2, 4000)))


def test_tied_keeps_values():
    tree = {"y": jnp.arange(4), "x": jnp.ones(3), "k": KEY}
    out = jax.jit(tied)(tree, jnp.float32(-2.5))
    np.testing.assert_array_equal(out["y"], tree["y"])
    np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(KEY))


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_rbg_tangents_are_the_same_under_vmap(distribution):
    """rbg bits under vmap over keys depend on the row; tangents must not (an engine that
    vmaps over micro-batch keys and one that loops must draw the same directions)."""
    spec = TangentSpec(2, distribution)
    keys = jax.random.split(jax.random.key(7, impl="rbg"), 3)
    rows = jax.jit(jax.vmap(lambda k: spec.sample(k, (4, 5))))(keys)
    for i in range(3):
        np.testing.assert_array_equal(rows[i], spec.sample(keys[i], (4, 5)))
