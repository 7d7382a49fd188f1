"""The local guess (Fournier et al.) on the shard_map pipeline: two passes of a forward-only
table (the stages' exact local-loss gradients U, then the derivatives along U) give the
in-memory estimator's gradient, with the shared head and a head per block; the engine trains
with it; a table with reverse chains is refused by name."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.experiment.engine_pipeline import PipelineEngine, PipelineEngineConfig
from jaxstream.experiment.engines import split_micro_batches
from jaxstream.pipeline import complete, gpipe_forward, pipeline
from tests.local_problem import local_problem
from tests.trees import max_rel_err


def _problem(own: bool):
    return local_problem(own, depth=4, micro_batches=4)


@pytest.mark.parametrize("stages, own", [(4, False), (2, True)],
                         ids=["4-stages-shared-head", "2-stages-own-heads"])
def test_pipeline_local_guess_equals_in_memory(stages, own):
    stack, params, micro, flat = _problem(own)
    pipe = pipeline(stack, gpipe_forward(stages, 4), jg.local_guess())
    key = jax.random.key(3)
    loss, grads, aux = pipe(params, micro, key)
    ref_loss, ref, ref_aux = jg.local_guess()(stack, params, flat, key, diagnostics=True)
    assert max_rel_err(grads, ref) <= 1e-5
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    # the derivative along U, per micro-batch: its mean is the in-memory d = ∇L·U
    assert float(np.mean(aux["directional"])) == pytest.approx(float(ref_aux["directional"]),
                                                               rel=1e-4, abs=1e-7)
    assert float(aux["guess_norm2"]) == pytest.approx(float(ref_aux["guess_norm2"]), rel=1e-5)


def test_engine_step_and_refusals():
    stack, params, _, flat = _problem(False)
    eng = PipelineEngine(PipelineEngineConfig(stages=2), stack=stack, estimator=jg.local_guess(),
                         optimizer=optax.sgd(0.1), micro_batches=4)
    state = eng.init(params, jax.random.key(0))
    new, _ = eng.step(state, flat, jax.random.key(5))
    _, ref = jg.local_guess()(stack, params, flat, jax.random.key(5))
    want = jax.tree.map(lambda p, g: np.asarray(p) - np.float32(0.1) * np.asarray(g), params, ref)
    assert max_rel_err(eng.params(new), want) <= 1e-5
    with pytest.raises(ValueError, match="must run on a forward-only table"):
        pipeline(stack, complete(2, 4, (0,)), jg.local_guess())
    with pytest.raises(ValueError, match="the local guess makes its own direction"):
        pipeline(stack, gpipe_forward(2, 4), jg.local_guess())(
            params, split_micro_batches(flat, 4), jax.random.key(5), guess=params)
