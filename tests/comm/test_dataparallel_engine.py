"""The ``dataparallel`` engine takes the same optimizer steps as the local engine (backprop)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstream.experiment.engine_dataparallel import (
    DataParallelEngineConfig,
    build_dataparallel_engine,
)
from jaxstream.experiment.engines import LocalEngine, LocalEngineConfig
from jaxstream.grad import backprop
from jaxstream.models import mlp
from jaxstream.optim import max_adabelief


def test_steps_equal_local_engine():
    stack = mlp(in_dim=8, width=8, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
        "y": jnp.asarray(rng.integers(0, 3, size=16), jnp.int32),
    }
    kw = {"stack": stack, "estimator": backprop(), "optimizer": max_adabelief(1e-2)}
    local = LocalEngine(LocalEngineConfig(), **kw)
    dp = build_dataparallel_engine(DataParallelEngineConfig(devices=8, allreduce="ring"), **kw)
    s_local, s_dp = local.init(params, None), dp.init(params, None)
    for i in range(3):
        key = jax.random.key(i)
        s_local, m_local = local.step(s_local, batch, key)
        s_dp, m_dp = dp.step(s_dp, batch, key)
        np.testing.assert_allclose(m_dp["loss"], m_local["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(dp.params(s_dp)), jax.tree.leaves(local.params(s_local))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_config_errors():
    with pytest.raises(ValueError, match="allreduce: 'tree' is not allowed"):
        DataParallelEngineConfig(allreduce="tree")
    with pytest.raises(ValueError, match="engine.devices: 64 requested"):
        build_dataparallel_engine(
            DataParallelEngineConfig(devices=64),
            estimator=backprop(),
            stack=None,
            optimizer=max_adabelief(1e-2),
        )
