"""What a user can get wrong when handing a model, a store, an optimizer or a batch to the
streamed executor: each refused by name before anything runs or is written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore, StoreMismatchError
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(6, 8, 2, 3)
CFG = StreamConfig(compute_dtype="float32")
SGD = optax.sgd(0.1)


def micro_batch(n=2, b=3):
    x = jax.random.normal(jax.random.key(1), (n, b, 6))
    return {"x": x, "y": jax.random.randint(jax.random.key(2), (n, b), 0, 3)}


@pytest.fixture
def store(tmp_path):
    return LayerStore.create(str(tmp_path / "s"), STACK.init(jax.random.key(0)), optimizer=SGD)


@pytest.mark.standard_promotion  # the test steps the bare optax optimizers itself
@pytest.mark.parametrize("name, optimizer", [
    ("clip_by_global_norm", optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))),
    ("lamb", optax.lamb(1e-2)),
])
def test_an_optimizer_that_is_not_element_wise_is_refused(tmp_path, name, optimizer):
    """Applied layer by layer it would train something else than in memory (checked here for
    the same optimizer: the whole model's update against the layers' updates one by one)."""
    params = STACK.init(jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)
    grads = tree.unflatten([jax.random.normal(jax.random.key(i), x.shape)
                            for i, x in enumerate(leaves)])
    whole, _ = optimizer.update(grads, optimizer.init(params), params)
    layer = lambda t: jax.tree.map(lambda x: x[0], t["blocks"])  # the first block's slice
    alone, _ = optimizer.update(layer(grads), optimizer.init(layer(params)), layer(params))
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(alone),
                                                     jax.tree.leaves(layer(whole))))
    s = LayerStore.create(str(tmp_path / "s"), params, optimizer=optimizer)
    with pytest.raises(ValueError, match="stream: optimizer is not element-wise"):
        StreamedExecutor(STACK, jg.backprop(), optimizer, s, CFG)
    assert s.step == 0


@pytest.mark.parametrize("optimizer", [optax.adam(1e-3), optax.sgd(0.1, momentum=0.9),
                                       optax.chain(optax.clip(1.0), optax.adamw(1e-3))])
def test_element_wise_optimizers_are_taken(tmp_path, optimizer):
    s = LayerStore.create(str(tmp_path / "s"), STACK.init(jax.random.key(0)), optimizer=optimizer)
    StreamedExecutor(STACK, jg.backprop(), optimizer, s, CFG).close()


@pytest.mark.standard_promotion
def test_an_optimizer_whose_probe_overflows_is_refused_not_taken(tmp_path):
    """lamb at lr 1e38 is inf / nan on every entry of both probe runs, which would compare
    equal and pass it as element-wise: refused as uncheckable, naming the learning rate."""
    opt = optax.lamb(1e38)
    s = LayerStore.create(str(tmp_path / "s"), STACK.init(jax.random.key(0)), optimizer=opt)
    with pytest.raises(ValueError, match="not finite on a probe.*learning rate"):
        StreamedExecutor(STACK, jg.backprop(), opt, s, CFG)


def test_a_store_of_another_model_is_refused(store):
    wider = mlp(6, 16, 2, 3)  # same depth and leaves, other widths
    with pytest.raises(StoreMismatchError, match="holds another model: embed leaf .* needs"):
        StreamedExecutor(wider, jg.backprop(), SGD, store, CFG)


def test_a_batch_and_key_are_checked_as_in_memory(store):
    """The same one-line errors as the in-memory estimators, before anything is staged; a
    legacy ``jax.random.PRNGKey`` is the same key as ``jax.random.key``."""
    ex = StreamedExecutor(STACK, jg.backprop(), SGD, store, CFG)
    batch = micro_batch()
    cases = [({**batch, "y": batch["y"].astype(jnp.float32) + 0.5}, jax.random.key(0),
              TypeError, r"stream: batch\['y'\] holds float32"),
             (jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), batch), jax.random.key(0),
              ValueError, "needs a leading micro-batch axis"),
             (batch, 0, TypeError, "stream: key must be a PRNG key"),
             # device labels out of range: read back and refused (a nan step was committed)
             ({**batch, "y": batch["y"] + 3}, jax.random.key(0), ValueError,
              r"stream: batch\['y'\] holds the label [3-5]; .*in \[0, 3\)")]
    for b, key, err, match in cases:
        for call in (ex.step, ex.estimate):
            with pytest.raises(err, match=match):
                call(b, key)
    assert store.step == 0
    loss, g = ex.estimate(batch, jax.random.key(7))
    loss_raw, g_raw = ex.estimate(batch, jax.random.PRNGKey(7))
    assert loss == loss_raw
    jax.tree.map(np.testing.assert_array_equal, g, g_raw)
    ex.close()


def test_a_store_of_other_leaf_names_is_refused(tmp_path):
    """Same shapes, other names (a refactored block: mlp_in / mlp_out vs up / down): the
    stored weights would land in other layers."""
    from flax import nnx

    import jaxstream as js

    def model(names):
        class Block(nnx.Module):
            def __init__(self, rngs):
                for n in names:
                    setattr(self, n, nnx.Linear(8, 8, rngs=rngs))

            def __call__(self, x):
                for n in names:
                    x = getattr(self, n)(x)
                return x

        layers = [nnx.Linear(6, 8, rngs=nnx.Rngs(0)), Block(nnx.Rngs(1)), Block(nnx.Rngs(2)),
                  nnx.Linear(8, 3, rngs=nnx.Rngs(3))]
        seq = js.models.from_sequential(nnx.Sequential(*layers), loss="cross_entropy")
        return seq, js.models.as_stack(seq)

    seq, view = model(["mlp_in", "mlp_out"])
    store = LayerStore.create(str(tmp_path / "s"), view.params(seq.init(None)), optimizer=SGD)
    _, other = model(["up", "down"])
    with pytest.raises(StoreMismatchError, match="holds another model: blocks leaf"):
        StreamedExecutor(other.stack, jg.backprop(), SGD, store, CFG)
    StreamedExecutor(view.stack, jg.backprop(), SGD, store, CFG).close()


@pytest.mark.standard_promotion
def test_an_optimizer_other_than_the_stores_is_refused(tmp_path):
    """sgd on adam's state trained with sgd and left adam's state behind; lion raised inside
    optax; adamw (adam's chain and one more entry, no leaves) raised inside optax mid-step;
    adabelief (the same leaf names) took adam's E[g²] for its belief, silently."""
    s = LayerStore.create(str(tmp_path / "s"), STACK.init(jax.random.key(0)),
                          optimizer=optax.adam(1e-3))
    for other in (optax.sgd(0.1), optax.lion(1e-3), optax.adamw(1e-3), optax.adabelief(1e-3)):
        with pytest.raises(StoreMismatchError, match="keeps the state of another optimizer"):
            StreamedExecutor(STACK, jg.backprop(), other, s, CFG)
    StreamedExecutor(STACK, jg.backprop(), optax.adam(1e-3), s, CFG).close()


def test_a_step_number_before_the_stores_and_a_closed_executor_are_refused(store):
    ex = StreamedExecutor(STACK, jg.backprop(), SGD, store, CFG)
    ex.step(micro_batch(), jax.random.key(0))
    ex.step(micro_batch(), jax.random.key(1))
    for bad in (0, -3):  # committed as step + 1: the store's step would go back (or < 0)
        with pytest.raises(ValueError, match=f"step: {bad} is before the store's step 2"):
            ex.step(micro_batch(), jax.random.key(2), step=bad)
    assert store.step == 2
    ex.close()
    with pytest.raises(RuntimeError, match="this executor is closed"):
        ex.step(micro_batch(), jax.random.key(2))
    assert store.step == 2


@pytest.mark.standard_promotion
def test_a_mask_that_reads_leaf_shapes_is_refused(tmp_path):
    """adamw decaying leaves with ndim > 1: in memory a block's bias is (L, d) and decayed,
    alone it is (d,) and not (streamed and in memory differed by 1 % after 5 steps)."""
    by_ndim = lambda p: jax.tree.map(lambda a: a.ndim > 1, p)
    opt = optax.adamw(1e-2, weight_decay=0.5, mask=by_ndim)
    params = STACK.init(jax.random.key(0))
    stacked = by_ndim(params["blocks"])
    alone = by_ndim(jax.tree.map(lambda a: a[0], params["blocks"]))
    assert jax.tree.leaves(stacked) != jax.tree.leaves(alone)  # the bias: decayed or not
    s = LayerStore.create(str(tmp_path / "s"), params, optimizer=opt)
    with pytest.raises(ValueError, match="treats a block layer alone differently than the "
                                         "stacked blocks"):
        StreamedExecutor(STACK, jg.backprop(), opt, s, CFG)
    same = optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda a: True, p))
    s2 = LayerStore.create(str(tmp_path / "s2"), params, optimizer=same)
    StreamedExecutor(STACK, jg.backprop(), same, s2, CFG).close()


@pytest.mark.standard_promotion
@pytest.mark.parametrize("kind", ["multi_transform", "masked"])
def test_a_mask_that_reads_the_top_level_keys_is_refused(tmp_path, kind):
    """Labels or a mask by the top-level key (freeze the embed, decay the blocks only): in
    memory the function sees "embed" / "blocks" / "head", a unit's own tree does not, and the
    streamed engine trained the embed. Refused before any step; a mask by
    leaf name inside a unit is taken."""
    by_top = lambda p: {k: jax.tree.map(lambda _, k=k: k == "embed", v) for k, v in p.items()}
    opt = (optax.multi_transform({True: optax.set_to_zero(), False: optax.adam(1e-2)}, by_top)
           if kind == "multi_transform" else
           optax.chain(optax.masked(optax.add_decayed_weights(0.5),
                                    lambda p: jax.tree.map(lambda x: not x, by_top(p))),
                       optax.sgd(0.1)))
    params = STACK.init(jax.random.key(0))
    grads = jax.tree.map(jnp.ones_like, params)
    embed = optax.apply_updates(params, opt.update(grads, opt.init(params), params)[0])["embed"]
    alone = optax.apply_updates(params["embed"], opt.update(
        grads["embed"], opt.init(params["embed"]), params["embed"])[0])
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(embed),
                                                     jax.tree.leaves(alone)))  # they differ
    s = LayerStore.create(str(tmp_path / "s"), params, optimizer=opt)
    with pytest.raises(ValueError, match="updates the embed alone otherwise than within the "
                                         "whole model's tree.*top-level keys"):
        StreamedExecutor(STACK, jg.backprop(), opt, s, CFG)
    by_name = optax.multi_transform(
        {True: optax.set_to_zero(), False: optax.adam(1e-2)},
        lambda p: jax.tree_util.tree_map_with_path(lambda k, _: "bias" in str(k), p))
    s2 = LayerStore.create(str(tmp_path / "s2"), params, optimizer=by_name)
    StreamedExecutor(STACK, jg.backprop(), by_name, s2, CFG).close()


def test_two_executors_on_one_store_keep_each_others_deferred_updates(tmp_path):
    """Steps alternating between two lazy executors on one store equal one executor's: each
    takes the deferred updates the other committed (it kept the records it had when built,
    and overwrote the other's: 49 % off after 4 steps)."""
    est = jg.forward(num_tangents=2)
    lazy = StreamConfig(compute_dtype="float32", update="lazy", rewrite_every=3)
    params = STACK.init(jax.random.key(0))
    one = LayerStore.create(str(tmp_path / "one"), params, optimizer=SGD)
    two = LayerStore.create(str(tmp_path / "two"), params, optimizer=SGD)
    keys = [jax.random.key(t) for t in range(4)]
    with StreamedExecutor(STACK, est, SGD, one, lazy) as ex:
        for k in keys:
            ex.step(micro_batch(), k)
        ex.flush()
    a = StreamedExecutor(STACK, est, SGD, two, lazy)
    b = StreamedExecutor(STACK, est, SGD, two, lazy)
    for t, k in enumerate(keys):
        (a if t % 2 == 0 else b).step(micro_batch(), k)
    b.flush()
    a.close(), b.close()
    jax.tree.map(np.testing.assert_array_equal, two.read_params(), one.read_params())
