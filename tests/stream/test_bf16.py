"""bf16 rows: every estimator streamed (stream and composed engines) with bf16 compute and an
fp32 master equals the in-memory estimator computed in bf16, within the bf16 rounding the
in-memory computation itself shows.

The tolerance, derived: let δ = err(in-memory bf16, in-memory fp32), the rounding bf16 compute
puts on this estimate. The engine's bf16 result differs from the fp32 one by its own rounding,
of the same operations in another order (micro-batches merged or one at a time, per-layer
programs, a mesh's sums), which we allow to be up to twice δ; by the triangle inequality
err(engine bf16, in-memory bf16) ≤ 2δ + δ = 3δ. A wrong key, layer or selection moves the
estimate by O(1), far beyond it (δ is about 1e-2 here), and an engine that silently computed
in fp32 would sit on the fp32 estimate, which the last check refuses.

Before these rows, the in-memory control-variate hybrids could not run in bf16 at all: the
residual scalars mixed bf16 derivatives with fp32 sums (strict promotion refused them); they
are now formed in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstream.grad as jg
from jaxstream.models import mlp
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamConfig, StreamedExecutor
from tests.trees import max_rel_err

N, B = 4, 8
STACK = mlp(in_dim=6, width=16, depth=4, num_classes=3)
ESTIMATORS = {  # name: (estimator, batch layout of its in-memory reference)
    "backprop": (jg.backprop(), "flat"),
    "forward-weights": (jg.forward(2), "flat"),
    "forward-activations": (jg.forward(2, perturb="activations"), "flat"),
    "hybrid-cv": (jg.hybrid(exact_indices=(0, 2), correction="control_variate",
                            num_tangents=2), "micro"),
    "hybrid-weighted": (jg.hybrid(exact_indices=(0, 2), correction="weighted"), "micro"),
}


def _problem():
    rng = np.random.default_rng(0)
    micro = {"x": rng.standard_normal((N, B, 6), dtype=np.float32),
             "y": rng.integers(0, 3, (N, B), dtype=np.int32)}
    flat = jax.tree.map(lambda a: a.reshape(N * B, *a.shape[2:]), micro)
    return STACK.init(jax.random.key(0)), micro, flat


def _in_memory(est, params, batch, key, dtype):
    p = jax.tree.map(lambda a: a.astype(dtype), params)
    b = {**batch, "x": jnp.asarray(batch["x"], dtype)}
    _, g = jax.jit(lambda pp, bb, kk: est(STACK, pp, bb, kk))(p, b, key)
    return jax.tree.map(lambda a: np.asarray(a, np.float32), g)


@pytest.mark.parametrize("engine", ["stream", "composed"])
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_bf16_engine_equals_the_bf16_in_memory_estimator(tmp_path, engine, name):
    est, layout = ESTIMATORS[name]
    params, micro, flat = _problem()
    data = flat if layout == "flat" else micro
    key = jax.random.key(3)
    ref32 = _in_memory(est, params, data, key, jnp.float32)
    ref16 = _in_memory(est, params, data, key, jnp.bfloat16)
    delta = max_rel_err(ref16, ref32)
    assert 1e-4 < delta < 0.1, delta  # bf16 rounding, visible and small
    store = LayerStore.create(tmp_path / "s", jax.device_get(params), optimizer=optax.sgd(0.1))
    cfg = StreamConfig(compute_dtype="bfloat16", prefetch=1)
    if engine == "stream":
        ex = StreamedExecutor(STACK, est, optax.sgd(0.1), store, cfg)
    else:
        from jaxstream.compose import ComposedExecutor, make_mesh

        ex = ComposedExecutor(STACK, est, optax.sgd(0.1), store, cfg, mesh=make_mesh(2, 2))
    _, got = ex.estimate(micro, key)
    got = jax.tree.map(lambda a: np.asarray(a, np.float32), got)
    err = max_rel_err(got, ref16)
    assert err <= 3 * delta, (err, delta)
    # and it did compute in bf16: as far from the fp32 estimate as bf16 rounding puts the
    # in-memory one (an engine that silently computed in fp32 would sit on ref32)
    assert max_rel_err(got, ref32) >= delta / 4, (max_rel_err(got, ref32), delta)
    store.close()
