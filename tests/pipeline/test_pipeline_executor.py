"""The shard_map executor equals the single-device estimators for the same keys and groups.

Together with the multiprocess, notebook and engine tests of tests/pipeline, every schedule policy
and every correction runs at least once on a multi-device mesh (a covering set, not the full
policy x correction product: each pipeline is one XLA compilation; see the note above
test_policy_equals_hybrid_4_devices). The
references (single-device forward estimate, jax.grad, the in-memory hybrid estimator) are jitted:
the same functions, compiled once instead of dispatched op by op. Data and the error metric use
NumPy (no eager XLA compilation per shape).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import jaxstream.grad as jg
from jaxstream.grad import corrections as cr
from jaxstream.grad.tangents import TangentSpec, combine, micro_key
from jaxstream.models import mlp
from jaxstream.pipeline import (
    Schedule,
    ScheduleError,
    complete,
    delayed,
    gpipe_backprop,
    gpipe_forward,
    one_f_one_b,
)
from jaxstream.pipeline import step as ex  # where the jitted step is built
from jaxstream.pipeline.executor import pipeline
from jaxstream.pipeline.lowering import exact_from
from tests.pipeline.tiny import tiny_setup
from tests.trees import max_rel_err

K = 2  # tangents


_setup = tiny_setup


_max_rel = max_rel_err


@functools.partial(jax.jit, static_argnums=0)
def _forward_reference(stack, params, batch, key):
    n = jax.tree.leaves(batch)[0].shape[0]
    spec = TangentSpec(K)
    keys = jax.vmap(lambda i: micro_key(key, i))(jnp.arange(n))
    losses, d = jax.vmap(lambda b, k: jg.stack_directional(stack, spec, params, b, k))(batch, keys)
    return losses.mean(), combine(spec, keys, d / (n * K), params)


def test_forward_only_equals_single_device():
    # (4, 6): the stack and shapes of the delayed test's step 0, which shares this reference
    m, n = 4, 6
    stack, params, batch = _setup(m, n)
    key = jax.random.key(7)
    loss, grads, aux = pipeline(stack, gpipe_forward(m, n), num_tangents=K,
                                correction="none")(params, batch, key)
    ref_loss, ref = _forward_reference(stack, params, batch, key)
    assert abs(float(loss - ref_loss)) <= 1e-6
    assert _max_rel(grads, ref) <= 1e-5
    assert aux["directional"].shape == (n, K)


@pytest.mark.parametrize("est", [
    jg.forward(K, "gaussian", perturb="activations"),
], ids=["activations"])
def test_forward_variants_equal_the_per_micro_batch_estimator(est):
    """Activity perturbation (Gaussian) on a forward-only table equals the in-memory estimator
    run per micro-batch n with key fold_in(key, n), averaged. Local losses and projection are
    checked the same way by tests/test_engine_matrix.py (pipeline-fwd-act-local, -fwd-w-proj)."""
    m, n = 4, 3
    stack, params, batch = _setup(m, n)
    key = jax.random.key(5)
    loss, grads, _ = pipeline(stack, gpipe_forward(m, n), est)(params, batch, key)

    @jax.jit
    def reference(params, batch):
        out = [est(stack, params, jax.tree.map(lambda a, i=i: a[i], batch), micro_key(key, i))
               for i in range(n)]
        return (sum(o[0] for o in out) / n, jax.tree.map(lambda *g: sum(g) / n, *[o[1] for o in out]))

    ref_loss, ref = reference(params, batch)
    assert abs(float(loss - ref_loss)) <= 1e-6
    assert _max_rel(grads, ref) <= 1e-5


def test_guess_differentiates_along_the_previous_steps_exact_mean():
    """A pipeline's guess direction must exist before its forward pass: step t uses step t−1's
    exact-subset mean (aux["direction"]); the first step returns its own exact mean h."""
    m, n, sel = 4, 4, (0, 2)
    sched = complete(m, n, sel)
    stack, params0, batch0 = _setup(m, n, seed=0)
    _, params1, batch1 = _setup(m, n, seed=10)
    pipe = pipeline(stack, sched, jg.hybrid(exact_indices=sel, correction="guess"))
    _, g0, aux0 = pipe(params0, batch0, jax.random.key(1))
    h0 = jax.tree.map(lambda *g: sum(g) / len(sel), *[
        jax.grad(stack)(params0, jax.tree.map(lambda a, i=i: a[i], batch0)) for i in sel])
    assert _max_rel(g0, h0) <= 1e-5 and _max_rel(aux0["direction"], h0) <= 1e-5
    _, g1, _ = pipe(params1, batch1, jax.random.key(2), guess=aux0["direction"])
    est = jg.hybrid(exact_indices=sel, correction="guess")
    _, ref = jax.jit(lambda p, b, u: est(stack, p, b, jax.random.key(2), guess=u))(
        params1, batch1, h0)
    assert _max_rel(g1, ref) <= 1e-5
    assert _max_rel(g1, h0) > 1e-2  # not the direction itself: scaled by ∇L·u of this batch


# Covering set (policy x correction), one pipeline compilation each, not the full product:
#   complete + weighted, 2 layers per stage: test_policy_equals_hybrid_4_devices (hybrid);
#   gpipe_forward + none: test_forward_only_equals_single_device (single-device forward);
#   delayed + control_variate (nested partial groups, stale): test_delayed_... (hand-built
#     reference);
#   gpipe_backprop (8 devices) and 1f1b (4 devices) + replace, every micro-batch selected with a
#     complete chain: test_all_selected_complete_equals_jax_grad (the hybrid estimator for these
#     groups is the exact gradient);
#   truncated + replace (nested partial groups), 4 devices over 2 processes:
#     test_pipeline_multiprocess.py (hybrid);
#   complete + control_variate, 4 devices: notebooks/02_pipeline_schedules.ipynb (hybrid,
#     test_pipeline_notebook.py); complete with every micro-batch selected + replace:
#     test_pipeline_engine.py::test_backprop_arm_is_exact (jax.grad).
@pytest.mark.parametrize("correction", ["weighted", "stein"])
def test_policy_equals_hybrid_4_devices(correction):
    _check_hybrid(complete(4, 6, (1, 4)), correction, layers_per_stage=2)


def _check_hybrid(sched, correction, layers_per_stage):
    m, n = sched.num_stages, sched.micro_batches
    stack, params, batch = _setup(m, n, layers_per_stage)
    key = jax.random.key(3)
    loss, grads, _ = pipeline(stack, sched, num_tangents=K, correction=correction)(
        params, batch, key)
    est = jg.hybrid(exact_from=exact_from(sched, stack.num_layers), correction=correction,
                    num_tangents=K)
    ref_loss, ref = jax.jit(lambda p, b, k: est(stack, p, b, k))(params, batch, key)
    assert abs(float(loss - ref_loss)) <= 1e-6
    assert _max_rel(grads, ref) <= 1e-5


@pytest.mark.parametrize("make,layers_per_stage", [
    (lambda: gpipe_backprop(8, 8), 1),
    (lambda: one_f_one_b(4, 3), 2),
], ids=["gpipe_backprop-8", "1f1b-4"])
def test_all_selected_complete_equals_jax_grad(make, layers_per_stage):
    # every micro-batch selected with a complete chain: the hybrid estimator with these groups
    # (exact_from all 0) and replace is the exact gradient, so jax.grad is the reference
    sched = make()
    m, n = sched.num_stages, sched.micro_batches
    stack, params, batch = _setup(m, n, layers_per_stage)
    assert set(exact_from(sched, stack.num_layers)) == {0}
    loss, grads, _ = pipeline(stack, sched, num_tangents=K, correction="replace")(
        params, batch, jax.random.key(0))
    mean_loss = lambda p: jnp.mean(jax.vmap(lambda b: stack(p, b))(batch))
    ref_loss, ref = jax.jit(jax.value_and_grad(mean_loss))(params)
    assert abs(float(loss - ref_loss)) <= 1e-6
    assert _max_rel(grads, ref) <= 1e-5


@pytest.mark.parametrize("correction", ["control_variate", "weighted"])
def test_delayed_uses_previous_step_exact_gradients(correction):
    m, n = 4, 6
    sched = delayed(m, n, (0, 3))
    stack, params0, batch0 = _setup(m, n, seed=0)
    _, params1, batch1 = _setup(m, n, seed=10)
    pipe = pipeline(stack, sched, num_tangents=K, correction=correction)
    carry = pipe.init_carry(params0, batch0)
    k0, k1 = jax.random.key(1), jax.random.key(2)
    _, g0, aux0 = pipe(params0, batch0, k0, carry)
    # step 0 has no previous step: the plain forward estimate (weighted too: its empty groups
    # give beta = 1; they used to keep their counts and shrink the estimate to about 0)
    assert _max_rel(g0, _forward_reference(stack, params0, batch0, k0)[1]) <= 1e-5
    if correction == "weighted":
        return
    _, g1, _ = pipe(params1, batch1, k1, aux0["carry"])
    # reference: h from the previous step's selected micro-batches at the previous params
    spec = TangentSpec(K)
    sel = jnp.array(pipe.lowered.prev_selected)
    depth = jnp.array([exact_from(sched, stack.num_layers)[j] for j in pipe.lowered.selected])

    @jax.jit
    def reference(params0, batch0, params1, batch1, k1):
        exact = jax.vmap(lambda b: jax.grad(stack)(params0, b))(
            jax.tree.map(lambda a: a[sel], batch0))
        h, _ = cr.group_mean(exact, cr.group_masks(params1, depth), params1)
        keys = jax.vmap(lambda i: micro_key(k1, i))(jnp.arange(n))
        _, d = jax.vmap(lambda b, k: jg.stack_directional(stack, spec, params1, b, k))(
            batch1, keys)
        return cr.control_variate(spec, keys, d, h, cr.residual_scalars(spec, keys, h), params1)

    assert _max_rel(g1, reference(params0, batch0, params1, batch1, k1)) <= 1e-5
    assert pipe._compiled["fn"]._cache_size() == 1  # no recompilation across steps


def test_bad_arguments_fail_before_compiling(monkeypatch):
    def no_compile(*a, **k):
        raise AssertionError("compiled")

    monkeypatch.setattr(ex, "_build", no_compile)
    stack, params, batch = _setup(4, 4)
    with pytest.raises(ValueError, match="num_stages=16 but only 8 devices"):
        pipeline(mlp(6, 5, 16, 3), gpipe_forward(16, 4))
    with pytest.raises(ValueError, match=r"only 2 devices are given .*pass at least 4 devices"):
        pipeline(stack, gpipe_forward(4, 4), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="devices: each stage needs its own device"):
        pipeline(stack, gpipe_forward(4, 4), devices=[jax.devices()[0]] * 4)
    with pytest.raises(ValueError, match="micro_batches=0"):
        gpipe_forward(4, 0)
    with pytest.raises(ValueError, match="selected micro-batch 4 outside 0..3"):
        complete(4, 4, (4,))
    bad = gpipe_forward(4, 4)
    bad.kind[3, 3] = 0  # drop F_0 on the last stage
    with pytest.raises(ScheduleError, match="micro-batch 0 has no F"):
        pipeline(stack, Schedule(bad.kind, bad.micro, bad.stale, 4))
    with pytest.raises(ValueError, match="num_layers=4 does not split into num_stages=3"):
        pipeline(stack, gpipe_forward(3, 4))
    with pytest.raises(ValueError, match="correction='bogus'"):
        pipeline(stack, gpipe_forward(4, 4), correction="bogus")
    with pytest.raises(ValueError, match="correction='replace' is not allowed"):
        pipeline(stack, delayed(4, 4, (0,)), correction="replace")
    pipe = pipeline(stack, gpipe_forward(4, 4))
    with pytest.raises(ValueError, match=r"batch\['x'\].*micro_batches=4"):
        pipe(params, {"x": batch["x"][:3], "y": batch["y"][:3]}, jax.random.key(0))
    with pytest.raises(ValueError, match="run on a forward-only table"):
        pipeline(stack, complete(4, 4, (0,)), jg.forward(perturb="activations"))
    with pytest.raises(ValueError, match="correction='guess' needs exact gradients"):
        pipeline(stack, gpipe_forward(4, 4), correction="guess")
    # the keywords mean what jaxstream.grad.forward's mean, refused alike (LG-FG-W has its own
    # estimator); the plans they build are grad's
    with pytest.raises(ValueError, match=r"local_losses=True needs perturb='activations'.*"
                                         r"local_forward_weights"):
        pipeline(stack, gpipe_forward(4, 4), perturb="weights", local_losses=True)
    for kw in ({}, {"perturb": "activations"}, {"perturb": "activations", "local_losses": True},
               {"aggregation": "projection", "num_tangents": 2}):
        assert pipeline(stack, gpipe_forward(4, 4), **kw).plan == jg.forward(**kw).plan
    assert pipeline(stack, complete(4, 4, (0, 2)), correction="weighted").plan == jg.hybrid(
        2, "weighted").plan
    with pytest.raises(ValueError, match="pass carry"):
        pipeline(stack, delayed(4, 4, (0,)))(params, batch, jax.random.key(0))


def test_backprop_remat_runs_as_the_backprop_table():
    """backprop_remat() on a pipeline: a stage's B op recomputes from its stashed input, so it
    is the backprop table; the gradient is the exact one."""
    stack, params, batch = tiny_setup(2, 3)
    flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), batch)
    loss, grads, _ = pipeline(stack, gpipe_backprop(2, 3), jg.backprop_remat())(
        params, batch, jax.random.key(0))
    ref_loss, ref = jax.value_and_grad(stack)(params, flat)
    assert max_rel_err(grads, ref) <= 1e-5 and abs(float(loss) - float(ref_loss)) <= 1e-6


@pytest.mark.parametrize("sched, est, match", [
    (complete(4, 8, (0, 1)), jg.backprop_remat(),
     (r"estimator backprop on schedule 'complete': backprop needs every one of the N=8 "
     r"micro-batches' complete reverse chains; the table carries \(0, 1\)")),
    (gpipe_forward(4, 8), jg.hybrid(exact_indices=(0, 1)),
     r"correction='control_variate' needs exact gradients; the table has no reverse chain"),
    (complete(4, 8, (0, 1)), jg.hybrid(exact_indices=(2, 3)),
     r"fixes exact_indices=\(2, 3\), the table's chains are \(0, 1\)"),
    (complete(4, 8, (0, 1)), jg.hybrid(num_exact=3), r"num_exact=3, the table carries 2 chains"),
])
def test_a_table_that_cannot_carry_the_plan_is_refused(monkeypatch, sched, est, match):
    """The pipeline reads the estimator's plan and refuses, naming both, a table that cannot
    carry it (a backprop estimator on a hybrid table used to run as a ``replace`` hybrid over
    the table's two chains, silently) — before anything is compiled."""
    monkeypatch.setattr(ex, "_build", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(ValueError, match=match):
        pipeline(mlp(6, 5, 4, 3), sched, est)


def test_a_wrong_feature_count_is_named():
    stack, params, batch = _setup(4, 4)
    pipe = pipeline(stack, gpipe_forward(4, 4))
    wide = {**batch, "x": jnp.concatenate([batch["x"], batch["x"][..., :1]], axis=-1)}
    with pytest.raises(ValueError, match=r"pipeline: batch\['x'\] \(float32, shape .* does not fit"):
        pipe(params, wide, jax.random.key(0))
