"""The engines that trace an estimator inside ``shard_map`` (the pipeline, data parallelism)
check its arguments first, as the in-memory estimators do: inside the trace the labels are
tracers, whose range cannot be read, and an int key fails deep in JAX. Out-of-range labels gave
loss nan with a zero gradient (an optimizer step that silently does nothing), float labels were
truncated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxstream as js
from jaxstream.comm.dataparallel import data_parallel
from jaxstream.pipeline import complete
from jaxstream.pipeline.executor import pipeline

STACK = js.models.mlp(4, 8, 4, 3)
KEY = jax.random.key(1)


def batch(shape, labels=None):
    x = jax.random.normal(jax.random.key(0), (*shape, 4))
    y = jax.random.randint(jax.random.key(2), shape, 0, 3) if labels is None else labels
    return {"x": x, "y": y}


def wrong(shape):
    """(batch, error, match) a user might hand an engine, each with what the in-memory
    estimators say."""
    good = batch(shape)
    return [
        (batch(shape, good["y"] + 5), ValueError,
         r"batch\['y'\] holds the label [5-7]; .*in \[0, 3\)"),
        (batch(shape, good["y"] - 1), ValueError, r"batch\['y'\] holds the label -1"),
        (batch(shape, good["y"].astype(jnp.float32) + 0.5), TypeError,
         r"batch\['y'\] holds float32"),
    ]


@pytest.mark.parametrize("estimator", [js.grad.backprop(), js.grad.forward(num_tangents=1)])
def test_data_parallel_checks_labels_and_key(estimator):
    dp = data_parallel(estimator, jax.make_mesh((4,), ("data",)))
    params = STACK.init(jax.random.key(0))
    for b, err, match in wrong((8,)):
        with pytest.raises(err, match="data_parallel: " + match):
            dp(STACK, params, b, KEY)
    with pytest.raises(TypeError, match="data_parallel: key must be a PRNG key.*got int"):
        dp(STACK, params, batch((8,)), 3)
    loss, _ = dp(STACK, params, batch((8,)), KEY)  # the same call with right arguments runs
    assert jnp.isfinite(loss)


def test_the_pipeline_checks_labels_and_key():
    pipe = pipeline(STACK, complete(2, 4, (0, 1)), correction="replace")
    params = STACK.init(jax.random.key(0))
    for b, err, match in wrong((4, 2)):
        with pytest.raises(err, match="pipeline: " + match):
            pipe(params, b, KEY)
    with pytest.raises(TypeError, match="pipeline: key must be a PRNG key.*got int"):
        pipe(params, batch((4, 2)), 3)
    loss, _, _ = pipe(params, batch((4, 2)), KEY)
    assert jnp.isfinite(loss)


def test_one_hot_labels_are_named_by_the_loss():
    """Labels shaped as the logits (one-hot) raised 'indices and arr must have the same number
    of dimensions' inside jnp.take_along_axis: the loss names the shape it takes, in every
    estimator and engine that runs it (checked at trace time: shapes are static)."""
    params = STACK.init(jax.random.key(0))
    b = batch((8,))
    one_hot = {**b, "y": jax.nn.one_hot(b["y"], 3).astype(jnp.int32)}
    for est in (js.grad.backprop(), js.grad.forward(num_tangents=1)):
        with pytest.raises(ValueError, match=r"batch\['y'\] has shape \(8, 3\).*one-hot"):
            est(STACK, params, one_hot, KEY)
    with pytest.raises(ValueError, match=r"batch\['y'\] has shape \(8, 2\); .* \(8,\)"):
        js.grad.backprop()(STACK, params, {**b, "y": jnp.zeros((8, 2), jnp.int32)}, KEY)
