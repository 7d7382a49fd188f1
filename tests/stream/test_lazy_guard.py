"""The divergence guard with lazy updates: a diverging update waits in the store as a record
until the layer's next read, so the commit it belongs to looks sane and the one after it
fails. The way back must not replay it: ``rollback_to_sane`` on a lazy store returns to
the state the eager store returns to (the step before the diverging one, its records dropped),
bit for bit, and training on from there equals the eager run's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.errors import StoreDivergedError, StoreNonFiniteError
from jaxstream.stream.executor import StreamConfig, StreamedExecutor

STACK = mlp(5, 6, 3, 4)
ESTIMATORS = {"forward": jg.forward(num_tangents=1),
              "hybrid": jg.hybrid(num_exact=2, num_tangents=2, correction="control_variate")}
BAD = 3  # the step whose update diverges: the blocks' kernels' learning rate is 1e9 there


def _by_kernel(spike: optax.GradientTransformation) -> optax.GradientTransformation:
    """``spike`` on the blocks' kernels (the lazily updated units' largest leaves), sgd at 1e-2
    elsewhere: the embed and head (updated eagerly) stay calm, so only the records diverge."""
    label = lambda p: jax.tree.map(lambda x: "spike" if x.shape[-2:] == (6, 6) else "calm", p)
    return optax.multi_transform({"spike": spike, "calm": optax.sgd(1e-2)}, label)


def _spiking(lr: float) -> optax.GradientTransformation:
    return _by_kernel(optax.sgd(lambda count: jnp.where(count == BAD, lr, 1e-2)))


OPT = _spiking(1e9)
CALM = _by_kernel(optax.sgd(optax.constant_schedule(1e-2)))  # the same state, no spike


def _batch(t: int) -> dict:
    r = np.random.default_rng(200 + t)
    return {"x": r.standard_normal((2, 4, 5)).astype(np.float32),
            "y": r.integers(0, 4, (2, 4)).astype(np.int32)}


def _key(t: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(3), t)


def _train(path, est, cfg: StreamConfig, steps: range, opt=OPT) -> LayerStore:
    """Steps until the store refuses to go on (the guard failed, or non-finite values were
    refused) or ``steps`` end."""
    store = LayerStore.open(path, optimizer=opt)
    with StreamedExecutor(STACK, est, opt, store, cfg) as ex:
        for t in steps:
            if store.sane_step != store.step:
                break
            try:
                ex.step(_batch(t), _key(t), step=t)
            except (StoreDivergedError, StoreNonFiniteError):
                break
    return store


def _settled(path, est, opt=OPT) -> list:
    """The store's parameters with its pending records applied (an eager flush)."""
    store = LayerStore.open(path, optimizer=opt)
    cfg = StreamConfig(compute_dtype="float32", update="lazy")
    with StreamedExecutor(STACK, est, opt, store, cfg) as ex:
        ex.flush()
    return jax.tree.leaves(store.read_params())


@pytest.mark.parametrize("name, k, spike", [("forward", 1, 1e9), ("forward", 3, 1e9),
                                            ("hybrid", 1, 1e9), ("forward", 1, 1e38),
                                            ("forward", 3, 1e38), ("hybrid", 1, 1e38)])
def test_a_lazy_rollback_does_not_replay_the_diverging_update(tmp_path, name, k, spike):
    """At 1e9 the guard fails on the norm; at 1e38 the update overflows: the eager step's
    write is refused (the store keeps the step before), the lazy step that applies the
    records finds them non-finite and fails the commit that holds them."""
    est, opt = ESTIMATORS[name], _spiking(spike)
    params = STACK.init(jax.random.key(0))
    runs = {"eager": StreamConfig(compute_dtype="float32"),
            "lazy": StreamConfig(compute_dtype="float32", update="lazy", rewrite_every=k)}
    for run, cfg in runs.items():
        LayerStore.create(str(tmp_path / run), params, optimizer=opt).close()
        store = _train(str(tmp_path / run), est, cfg, range(8), opt)
        assert store.sane_step == BAD, f"{run}: the guard did not see the step"
        assert store.step > BAD or (run, spike) == ("eager", 1e38)
        store.close()
    eager = LayerStore.open(str(tmp_path / "eager"), optimizer=opt)
    lazy_store = LayerStore.open(str(tmp_path / "lazy"), optimizer=opt)
    assert eager.rollback_to_sane() == BAD
    assert lazy_store.rollback_to_sane() == BAD  # not BAD + 1: its records are dropped
    eager.close(), lazy_store.close()
    for a, b in zip(_settled(str(tmp_path / "eager"), est, opt),
                    _settled(str(tmp_path / "lazy"), est, opt)):
        np.testing.assert_array_equal(a, b)
    # Training on from there at a calm rate equals the eager run's, sanely.
    for run, cfg in runs.items():
        store = LayerStore.open(str(tmp_path / run), optimizer=CALM)
        with StreamedExecutor(STACK, est, CALM, store, cfg) as ex:
            for t in range(BAD, BAD + 3):
                ex.step(_batch(t), _key(t), step=t)
        assert store.sane_step == store.step == BAD + 3, run
        store.close()
    for a, b in zip(_settled(str(tmp_path / "eager"), est, CALM),
                    _settled(str(tmp_path / "lazy"), est, CALM)):
        np.testing.assert_array_equal(a, b)


def test_with_skipped_layers_the_way_back_is_exact_or_refused(tmp_path):
    """A depth policy that skips layers keeps a layer's deferred update waiting past the next
    commit, unjudged; when it diverges on a later read, the state before it is gone (two
    versions of a layer are kept). ``rollback_to_sane`` then refuses by name, leaving the store
    as it was; where only the last step's updates were unjudged it returns to the eager
    store's state. Over four depth seeds both happen."""
    from jaxstream.stream import DepthPolicy
    from jaxstream.stream.errors import StoreError

    spike = _by_kernel(optax.sgd(lambda count: jnp.where(count == 2, 1e9, 1e-2)))
    est, params, outcomes = ESTIMATORS["forward"], STACK.init(jax.random.key(0)), []
    for seed in range(4):
        depth = DepthPolicy(kind="stochastic", keep_prob=0.4, seed=seed)
        paths = {}
        for run, cfg in {"eager": {}, "lazy": {"update": "lazy"}}.items():
            paths[run] = str(tmp_path / f"{run}{seed}")
            LayerStore.create(paths[run], params, optimizer=spike).close()
            _train(paths[run], est, StreamConfig(compute_dtype="float32", depth=depth, **cfg),
                   range(10), spike).close()
        eager = LayerStore.open(paths["eager"], optimizer=spike)
        eager.rollback_to_sane()
        eager.close()
        lazy_store = LayerStore.open(paths["lazy"], optimizer=spike)
        manifest = (tmp_path / f"lazy{seed}" / "manifest.json").read_bytes()
        try:
            back = lazy_store.rollback_to_sane()
        except StoreError as err:
            assert "cannot roll back to a sane state" in str(err) and "skipped" in str(err)
            assert (tmp_path / f"lazy{seed}" / "manifest.json").read_bytes() == manifest
            outcomes.append("refused")
            continue
        finally:
            lazy_store.close()
        assert back == LayerStore.open(paths["eager"]).step
        for a, b in zip(_settled(paths["eager"], est, spike), _settled(paths["lazy"], est, spike)):
            np.testing.assert_array_equal(a, b)
        outcomes.append("exact")
    assert outcomes[0] == "refused" and "exact" in outcomes, outcomes
