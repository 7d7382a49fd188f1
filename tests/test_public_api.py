"""``import jaxstream as js`` gives the subpackages (loaded on first use) and ``js.train_step``."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstream as js

SUBPACKAGES = ("grad", "models", "quality", "pipeline", "stream", "comm", "optim", "placement",
               "data", "experiment", "compose")


def test_import_is_lazy_and_every_subpackage_is_an_attribute():
    code = ("import sys, jaxstream as js; assert 'jax' not in sys.modules, 'jax imported'; "
            f"[getattr(js, n) for n in {SUBPACKAGES!r}]; "
            "assert callable(js.grad.forward) and callable(js.train_step); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert set(SUBPACKAGES) <= set(dir(js))
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        js.nosuch  # noqa: B018


def test_train_step_matches_a_hand_written_update():
    stack = js.models.mlp(6, 8, 1, 3)
    params = stack.init(jax.random.key(0))
    batch = {"x": jax.random.normal(jax.random.key(1), (5, 6)), "y": jnp.arange(5) % 3}
    step = js.train_step(js.grad.backprop(), optax.sgd(0.1), stack)
    opt_state = step.init(params)
    new, opt_state, loss = step(params, opt_state, batch, jax.random.key(2))
    ref_loss, g = jax.value_and_grad(stack)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    jax.tree.map(lambda a, p, gg: np.testing.assert_allclose(a, p - 0.1 * gg, rtol=1e-5,
                                                              atol=1e-7), new, params, g)
    with pytest.raises(TypeError, match="optimizer: expected an optax"):
        js.train_step(js.grad.backprop(), 0.1, stack)
