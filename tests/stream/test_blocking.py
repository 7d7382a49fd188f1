"""A steady streamed step never waits for the device on the main thread (DESIGN §9).

Counted from outside the code under test (:mod:`tests.stream.blocking`): the blocking
device→host materialisations on the main thread during a steady step (after two warm-up
steps: the first compiles, the second applies the first lazy records) are the step's few
scalars (loss, directional derivatives, the selection), the same at depth 4 and depth 8; and
the step traces nothing and runs the same number of eager ops at either depth (host-side
per-layer work is jitted)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from tests.stream.blocking import count_blocking, count_steady_step

N, B = 4, 3
SGD = optax.sgd(0.1)
# (estimator, update, most blocking reads per step): each a per-step scalar or small array,
# none per layer
CASES = {
    "backprop": (jg.backprop(), "eager", 1),  # the losses
    # losses and d (one transfer), the K coefficients (formed on the host)
    "forward": (jg.forward(num_tangents=2), "eager", 2),
    # the key (the lazy record) read with losses and d
    "forward-lazy": (jg.forward(num_tangents=2), "lazy", 2),
    "forward-activations": (jg.forward(perturb="activations"), "eager", 1),  # the loss
    # one transfer per sweep: the selection, its depths and the key (the combine record);
    # losses and d; the rule's totals and ‖h‖² (after the reverse sweep)
    "hybrid": (jg.hybrid(num_exact=2, num_tangents=2), "eager", 3),
    "hybrid-lazy": (jg.hybrid(num_exact=2, num_tangents=2), "lazy", 3),
    "local-guess": (jg.local_guess(), "eager", 2),  # loss with ‖U‖², d along U
}


def _steady(tmp_path, depth: int, case: str, stash_bytes: int | None = None):
    """(blocking counter, dispatch counter) of the third step of ``case`` at ``depth``."""
    est, update, _ = CASES[case]
    stack = mlp(6, 8, depth, 3)
    store = LayerStore.create(tmp_path / f"s{depth}", stack.init(jax.random.key(0)),
                              optimizer=SGD)
    ex = StreamedExecutor(stack, est, SGD, store, StreamConfig(
        compute_dtype="float32", update=update, stash_bytes=stash_bytes))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((N, B, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (N, B))}
    return count_steady_step(ex, batch)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_steady_step_blocks_a_few_times_whatever_the_depth(tmp_path, case):
    (b4, d4), (b8, d8) = (_steady(tmp_path, depth, case) for depth in (4, 8))
    assert b4.total == b8.total, (dict(b4.sites), dict(b8.sites))
    assert b8.total <= CASES[case][2], dict(b8.sites)
    assert d4.traces == d8.traces == 0
    assert d4.eager == d8.eager  # no eager op per layer


def test_spilled_stash_blocks_no_more(tmp_path):
    """Block inputs beyond the stash budget go to the host asynchronously: a hybrid whose
    budget holds nothing blocks as often as one whose budget holds everything."""
    kept, _ = _steady(tmp_path / "kept", 4, "hybrid")
    spilled, _ = _steady(tmp_path / "spilled", 4, "hybrid", stash_bytes=0)
    assert spilled.total == kept.total <= CASES["hybrid"][2]


def test_counter_sees_a_blocking_read(tmp_path):
    """The counter counts what it must: a float() and an np.asarray() of a device array on
    the main thread, nothing on another thread."""
    import threading

    x = jax.numpy.ones(3) * 2
    with count_blocking() as c:
        float(x[0])
        np.asarray(x)
        t = threading.Thread(target=lambda: np.asarray(x))
        t.start()
        t.join()
    assert c.total == 2 and c.by == {"__float__": 1, "np.asarray": 1}


def test_read_together_is_one_exact_transfer():
    """A pytree of mixed dtypes and shapes comes back in one read, bit for bit as read leaf
    by leaf (bf16 and float16 widened and narrowed back, ints, uint32 key data, bools)."""
    from jaxstream.stream.readback import read_together

    jnp = jax.numpy
    tree = {"loss": jnp.float32(1.25) / 3, "d": jnp.linspace(-1, 1, 6).reshape(3, 2),
            "bf": (jnp.arange(5) / 7).astype(jnp.bfloat16), "h": jnp.float16(-0.1) * 3,
            "idx": jnp.array([3, -1], jnp.int32), "key": jax.random.key_data(jax.random.key(7)),
            "mask": jnp.arange(4) > 1, "none": None, "host": np.float32(2.0)}
    want = jax.tree.map(np.asarray, tree)
    with count_blocking() as c:
        got = read_together(tree)
    assert c.total == 1, dict(c.by)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8))
