"""Forward passes are objects engines read: a pass registered here, in the test (no library
file touched), runs on the engines its declarations name and equals its in-memory estimator
there; one that declares fewer engines is refused by them, by name."""

from __future__ import annotations

import dataclasses

import jax
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.grad import passes
from jaxstream.grad.plan import Plan
from jaxstream.pipeline import gpipe_forward, pipeline
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from tests.local_problem import local_problem
from tests.trees import max_rel_err


@dataclasses.dataclass(frozen=True)
class Renamed:
    """A user's estimator: another estimator's arithmetic under a forward pass of its own."""

    inner: object
    forward_pass: str

    @property
    def plan(self) -> Plan:
        return dataclasses.replace(self.inner.plan, forward=self.forward_pass)

    def __call__(self, loss_fn, params, batch, key=None, **kw):
        return self.inner(loss_fn, params, batch, key, **kw)


@pytest.fixture(scope="module")
def registered():
    """Two passes a user registers: the weights' and the local activations' declarations under
    new names, one on every engine, one in memory only."""
    made = [passes.register(passes.ForwardPass("test_weights", "test weights", "weights")),
            passes.register(passes.ForwardPass(
                "test_local", "test local", "activations", local_losses=True)),
            passes.register(passes.ForwardPass("test_memory_only", "memory only", "weights",
                                               engines=frozenset({"memory"})))]
    yield made
    for fp in made:
        passes._PASSES.pop(fp.name)


@pytest.mark.parametrize("name, inner", [("test_weights", jg.forward(2)),
                                         ("test_local", jg.forward(perturb="activations",
                                                                   local_losses=True))])
def test_a_registered_pass_streams_and_pipelines_as_in_memory(tmp_path, registered, name, inner):
    est = Renamed(inner, name)
    assert est.plan.forward_pass.name == name and "test" in est.plan.describe()
    stack, params, micro, flat = local_problem(False, depth=4, micro_batches=4)
    key = jax.random.key(7)
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    ex = StreamedExecutor(stack, est, optax.sgd(0.1), store,
                          StreamConfig(compute_dtype="float32", prefetch=1))
    _, streamed = ex.estimate(micro, key)  # its micro-batches computed as one flat batch
    _, ref = est(stack, params, flat, key)
    assert max_rel_err(streamed, ref) <= 1e-5
    # the pipeline: micro-batch n with key fold_in(key, n), averaged
    _, piped, _ = pipeline(stack, gpipe_forward(4, 4), est)(params, micro, key)
    per = [est(stack, params, jax.tree.map(lambda a, n=n: a[n], micro), jax.random.fold_in(key, n))
           for n in range(4)]
    assert max_rel_err(piped, jax.tree.map(lambda *g: sum(g) / 4, *[g for _, g in per])) <= 1e-5
    assert max_rel_err(ref, jax.grad(stack)(params, flat)) > 1e-2  # an estimate, not the grad


def test_a_pass_declared_in_memory_only_is_refused_by_the_engines(tmp_path, registered):
    est = Renamed(jg.forward(), "test_memory_only")
    stack, params, micro, _ = local_problem(False, depth=4, micro_batches=4)
    loss, _ = est(stack, params, jax.tree.map(lambda a: a[0], micro), jax.random.key(0))
    assert float(loss) > 0  # in memory it runs
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"stream: forward\(memory only, K=1\) needs a "
                                         r"'test_memory_only' forward pass, which the stream "
                                         r"engine does not run \(it runs \(.*'test_weights'"):
        StreamedExecutor(stack, est, optax.sgd(0.1), store, StreamConfig())
    with pytest.raises(ValueError, match="'test_memory_only' forward pass, which the pipeline"):
        pipeline(stack, gpipe_forward(4, 4), est)
    assert store.step == 0


def test_registry_refuses_unknown_and_repeated_names():
    with pytest.raises(ValueError, match=r"plan.forward: 'nope'; allowed: \('none', 'weights'"):
        Plan("nope", "none")
    with pytest.raises(ValueError, match="'weights' is already registered"):
        passes.register(passes.ForwardPass("weights", "weights", "weights"))
    with pytest.raises(ValueError, match=r"engines: \['gpu'\] are not engines"):
        passes.ForwardPass("x", "x", None, engines=frozenset({"gpu"}))
    # the declarations the engines read, for the shipped passes
    got = {n: (fp.scalars, fp.forms_block_estimates, fp.local_losses, fp.guess)
           for n in passes.names() if not n.startswith("test_") and (fp := passes.get(n))}
    assert got == {"none": (False, False, False, False), "weights": (True, False, False, False),
                   "activity": (False, True, False, False), "local": (False, True, True, False),
                   "local_weights": (False, True, True, False),
                   "local_guess": (False, False, True, True),
                   "zeroth_order": (False, False, False, False)}
