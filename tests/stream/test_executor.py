"""Streamed steps equal the in-memory estimators and optimizer for the same keys (fp32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.depth import DepthPolicy
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from tests.trees import max_rel_err

N, B = 4, 3
STACK = mlp(6, 8, 3, 3)
FP32 = StreamConfig(compute_dtype="float32", prefetch=2)
# One instance of each optimizer: the host update (jitted with the optimizer static) compiles
# once per optimizer instance.
SGD, ADAM = optax.sgd(0.1), optax.adam(1e-2)



@pytest.fixture(scope="module")
def data():
    params = STACK.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (N, B, 6))
    y = jax.random.randint(jax.random.key(2), (N, B), 0, 3)
    micro = {"x": x, "y": y}
    flat = {"x": x.reshape(N * B, 6), "y": y.reshape(N * B)}
    return params, micro, flat


# What tests/test_engine_matrix.py does not already cover for the stream engine: a random
# selection (``num_exact``) for the hybrids, nested groups with stein / weighted, exact_subset.
# (The matrix covers backprop, every forward variant, activity with and without local losses,
# replace and the nested control variate with the same keys.) The forward estimators of the
# lazy-update and depth tests share one tangent spec (gaussian), the hybrids another
# (rademacher), so they share their compiled streamed kernels.
ESTIMATORS = {
    "backprop": (jg.backprop(), "flat"),  # used by the step tests below
    "forward": (jg.forward(num_tangents=2, distribution="gaussian"), "flat"),  # ditto
    "hybrid_cv": (jg.hybrid(num_exact=2, num_tangents=2), "micro"),
    "hybrid_guess": (jg.hybrid(num_exact=2, correction="guess", num_tangents=2), "micro"),
    "hybrid_weighted": (jg.hybrid(num_exact=2, correction="weighted", num_tangents=2), "micro"),
    # nested per-layer groups (L = 3): micro-batch 0 exact everywhere, 1 from block 2 up, 3 only
    # at the head, 2 nowhere
    "hybrid_nested_stein": (jg.hybrid(exact_from=(0, 2, 4, 1), correction="stein",
                                      num_tangents=2), "micro"),
    "hybrid_nested_weighted": (jg.hybrid(exact_from=(0, 2, 4, 1), correction="weighted",
                                         num_tangents=2), "micro"),
    "exact_subset": (jg.exact_subset(2), "micro"),
}
_REFERENCES: dict = {}


def reference(name):
    """The in-memory estimator ``name``, jitted once per module (tests share its compilation)."""
    if name not in _REFERENCES:
        _REFERENCES[name] = jax.jit(ESTIMATORS[name][0], static_argnums=0)
    return _REFERENCES[name]


@jax.jit
def _adam_reference_step(g, s, p):
    u, s = ADAM.update(g, s, p)
    return optax.apply_updates(p, u), s


@pytest.mark.parametrize("name", sorted(set(ESTIMATORS) - {"backprop", "forward"}))
def test_streamed_gradients_equal_in_memory(tmp_path, data, name):
    params, micro, flat = data
    est, layout = ESTIMATORS[name]
    key = jax.random.key(11)
    store = LayerStore.create(tmp_path / "s", params, optimizer=SGD)
    ex = StreamedExecutor(STACK, est, SGD, store, FP32)
    loss, grads = ex.estimate(micro, key)
    ref_loss, ref = reference(name)(STACK, params, flat if layout == "flat" else micro, key)
    assert abs(loss - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert max_rel_err(grads, ref) <= 1e-6
    # a different key gives a different estimate (the comparison is not vacuous)
    if name != "backprop":
        _, other = ex.estimate(micro, jax.random.key(12))
        assert max_rel_err(other, ref) > 1e-3


@pytest.mark.standard_promotion  # steps optax.adam itself
@pytest.mark.parametrize("name", ["forward", "hybrid_cv", "backprop"])
def test_streamed_steps_equal_in_memory_adam(tmp_path, data, name):
    params, micro, flat = data
    est, layout = ESTIMATORS[name]
    opt = ADAM
    store = LayerStore.create(tmp_path / "s", params, optimizer=opt)
    ex = StreamedExecutor(STACK, est, opt, store, FP32)
    p, s = params, opt.init(params)
    for t in range(2):
        key = jax.random.key(100 + t)
        ex.step(micro, key)
        _, g = reference(name)(STACK, p, flat if layout == "flat" else micro, key)
        p, s = _adam_reference_step(g, s, p)
    reopened = LayerStore.open(tmp_path / "s", template=params, optimizer=opt)
    assert reopened.step == 2
    assert max_rel_err(reopened.read_params(), p) <= 1e-6
    assert max_rel_err(reopened.read_params(), params) > 1e-4  # training moved the params


def test_lazy_updates_equal_eager(tmp_path, data):
    params, micro, _ = data
    opt = ADAM
    est = ESTIMATORS["forward"][0]
    runs = {}
    for mode in ("eager", "lazy"):
        store = LayerStore.create(tmp_path / mode, params, optimizer=opt)
        ex = StreamedExecutor(STACK, est, opt, store, StreamConfig(prefetch=2, compute_dtype="float32", update=mode))
        for t in range(3):
            ex.step(micro, jax.random.key(200 + t))
            if mode == "lazy" and t == 1:
                # an estimate between steps applies the pending records only for itself: the
                # store keeps its committed step and records, the next step applies them
                before = store.read_params()
                ex.estimate(micro, jax.random.key(9))
                after = LayerStore.open(tmp_path / mode)
                assert after.step == 2 and after.extra["pending"]
                assert max_rel_err(after.read_params(), before) == 0.0
        if mode == "lazy":
            assert LayerStore.open(tmp_path / mode).extra["pending"]  # updates really deferred
            ex.flush()
        runs[mode] = LayerStore.open(tmp_path / mode).read_params()
    assert max_rel_err(runs["lazy"], runs["eager"]) <= 1e-6
    assert max_rel_err(runs["eager"], params) > 1e-4


def test_overlapped_host_updates_equal_in_line(tmp_path, data):
    """The host update beside the next unit's compute writes exactly what the in-line update
    writes (parameters and Adam state, bit for bit), and a failed update raises from the step
    and leaves the store at its last commit."""
    params, micro, _ = data
    est = jg.hybrid(num_exact=2, num_tangents=2, correction="weighted")
    stores = {}
    for overlap in (False, True):
        store = LayerStore.create(tmp_path / str(overlap), params, optimizer=ADAM)
        ex = StreamedExecutor(STACK, est, ADAM, store,
                              StreamConfig(compute_dtype="float32", overlap_update=overlap))
        for t in range(2):
            m = ex.step(micro, jax.random.key(300 + t))
        assert m["wait_update_s"] >= 0.0 and m["host_update_s"] > 0.0
        stores[overlap] = LayerStore.open(tmp_path / str(overlap), optimizer=ADAM)
    assert max_rel_err(stores[True].read_params(), stores[False].read_params()) == 0.0
    for u in ("embed", 0, 2, "head"):
        a, b = stores[True].read_opt(u).result(), stores[False].read_opt(u).result()
        assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    def broken(*_a, **_k):
        raise OSError("disk gone")
    ex.queue.apply_update = broken  # the worker's failure surfaces in the step, nothing is committed
    before = LayerStore.open(tmp_path / "True").read_params()
    with pytest.raises(OSError, match="disk gone"):
        ex.step(micro, jax.random.key(302))
    after = LayerStore.open(tmp_path / "True")
    assert after.step == 2 and max_rel_err(after.read_params(), before) == 0.0


def test_bf16_compute_close_to_fp32(tmp_path, data):
    params, micro, flat = data
    store = LayerStore.create(tmp_path / "s", params)
    ex = StreamedExecutor(STACK, jg.backprop(), SGD, store, StreamConfig(compute_dtype="bfloat16"))
    loss, grads = ex.estimate(micro, jax.random.key(0))
    ref_loss, ref = reference("backprop")(STACK, params, flat, None)
    assert abs(loss - float(ref_loss)) < 0.05 * abs(float(ref_loss))
    assert max_rel_err(grads, ref) < 0.1


def test_progressive_depth_equals_sliced_model(tmp_path, data):
    params, micro, flat = data
    policy = DepthPolicy("progressive", start=2, grow=1, every=10)
    store = LayerStore.create(tmp_path / "s", params)
    est = ESTIMATORS["forward"][0]
    ex = StreamedExecutor(STACK, est, SGD, store, StreamConfig(compute_dtype="float32", depth=policy))
    assert ex.layers(0) == (0, 1) and ex.layers(25) == (0, 1, 2)
    key = jax.random.key(5)
    loss, grads = ex.estimate(micro, key, step=0)
    small = mlp(6, 8, 2, 3)
    sliced = {"embed": params["embed"], "head": params["head"],
              "blocks": jax.tree.map(lambda a: a[:2], params["blocks"])}
    ref_loss, ref = jax.jit(est, static_argnums=0)(small, sliced, flat, key)
    assert abs(loss - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    got = {"embed": grads["embed"], "head": grads["head"],
           "blocks": jax.tree.map(lambda a: a[:2], grads["blocks"])}
    assert max_rel_err(got, ref) <= 1e-6
    np.testing.assert_array_equal(jax.tree.leaves(grads["blocks"])[0][2], 0.0)


def test_stochastic_depth_skips_reads_and_writes(tmp_path, data):
    params, micro, _ = data
    policy = DepthPolicy("stochastic", keep_prob=0.5, seed=3)
    layers = policy.layers(0, 3)
    skipped = [l for l in range(3) if l not in layers]
    assert skipped, "pick a seed that skips a layer"
    store = LayerStore.create(tmp_path / "s", params, optimizer=SGD)
    ex = StreamedExecutor(STACK, jg.backprop(), SGD, store,
                          StreamConfig(compute_dtype="float32", depth=policy))
    m = ex.step(micro, jax.random.key(0), step=0)
    read = sorted({l for e in ex.events for l in e.unit.layers})
    assert read == sorted(layers) and m["layers_read"] > 0
    after = LayerStore.open(tmp_path / "s").read_params()
    for l in skipped:
        for a, b in zip(jax.tree.leaves(after["blocks"]), jax.tree.leaves(params["blocks"])):
            np.testing.assert_array_equal(a[l], np.asarray(b[l]))
    for l in layers:
        assert not np.array_equal(jax.tree.leaves(after["blocks"])[0][l],
                                  np.asarray(jax.tree.leaves(params["blocks"])[0][l]))


def test_bad_config_errors(tmp_path, data):
    params, _, _ = data
    store = LayerStore.create(tmp_path / "s", params)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        StreamConfig(compute_dtype="int8")
    # backprop updates in its reverse sweep: lazy changes nothing there, and is accepted
    StreamedExecutor(STACK, jg.backprop(), SGD, store, StreamConfig(update="lazy"))
    with pytest.raises(ValueError, match="lazy' needs the forward estimator with perturb"):
        StreamedExecutor(STACK, jg.forward(perturb="activations"), SGD, store,
                         StreamConfig(update="lazy"))
    with pytest.raises(ValueError, match="store has 3 layers"):
        StreamedExecutor(mlp(6, 8, 2, 3), jg.backprop(), SGD, store)
    with pytest.raises(TypeError, match="estimator must be .*got HybridActivity"):
        StreamedExecutor(STACK, jg.hybrid_activity(), SGD, store)


def test_streamed_forward_equals_in_memory_forward(tmp_path, data):
    from jaxstream.grad.directional import stack_directional

    params, micro, _ = data
    store = LayerStore.create(tmp_path / "s", params)
    est = jg.forward(num_tangents=2)
    ex = StreamedExecutor(STACK, est, SGD, store, StreamConfig(prefetch=1, compute_dtype="float32"))
    key = jax.random.key(3)
    losses, d = ex.forward(micro, key)
    for n in range(N):
        one = jax.tree.map(lambda a, n=n: a[n], micro)
        loss, dn = jax.jit(stack_directional, static_argnums=(0, 1))(STACK, est.spec, params, one, key)
        # fp32 sums in another order (a layer at a time against one scan): the engines' 1e-5
        np.testing.assert_allclose(losses[n], loss, rtol=1e-6)
        np.testing.assert_allclose(d[n], dn, rtol=1e-5, atol=1e-7)
    logits = STACK.apply(params, micro["x"][0])
    assert np.allclose(losses[0], float(jnp.mean(STACK.example_loss(logits, jax.tree.map(lambda a: a[0], micro)))), rtol=1e-6)


def test_allocate_then_write_layers(tmp_path, data):
    params, _, _ = data
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    store = LayerStore.create(tmp_path / "s", shapes, optimizer=optax.adam(1e-3))
    for l in range(STACK.num_layers):
        store.write(l, jax.tree.map(lambda a, l=l: np.asarray(a[l]), params["blocks"]))
    store.write("embed", params["embed"])
    store.write("head", params["head"])
    store.commit(0)
    assert max_rel_err(LayerStore.open(tmp_path / "s").read_params(), params) == 0.0


def test_prefetch_threads_start_once_and_end_with_the_executor(tmp_path, data):
    """Every sweep loads on the executor's own prefetch threads (started with its first sweep,
    not per sweep), and :meth:`close` ends them. Counted from outside: the process's threads by
    name before, between and after steps."""
    import threading

    params, micro, _ = data
    store = LayerStore.create(str(tmp_path / "s"), params, optimizer=SGD)

    def loaders():
        return {t for t in threading.enumerate() if t.name.startswith("jaxstream-prefetch")}

    before = loaders()
    ex = StreamedExecutor(STACK, jg.backprop(), SGD, store, FP32)
    ex.step(micro, jax.random.key(0))  # two sweeps: forward, reverse
    first = loaders() - before
    assert 1 <= len(first) <= FP32.prefetch
    for s in (1, 2):
        ex.step(micro, jax.random.key(s))
        assert loaders() - before == first  # the same threads: none started, none ended
    ex.close()
    assert not any(t.is_alive() for t in first)
