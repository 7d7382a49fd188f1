"""A user's sequential model handed to an engine built on blocks: the view, the sequential
model or the nnx module itself (instead of ``view.stack``), and the model's own parameters
(instead of ``view.params(params)``), each refused with the fix before anything runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxstream as js
from jaxstream.pipeline import complete
from jaxstream.pipeline.executor import pipeline
from jaxstream.stream import LayerStore
from jaxstream.stream.executor import StreamedExecutor


def user_model():
    """Linear → 4 × (Linear, relu) → Linear: four blocks of a repeated pair."""
    inner = [m for i in range(4) for m in (nnx.Linear(16, 16, rngs=nnx.Rngs(i + 1)), nnx.relu)]
    seq = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), *inner,
                         nnx.Linear(16, 4, rngs=nnx.Rngs(9)))
    return seq, js.models.from_sequential(seq, loss="cross_entropy")


@pytest.fixture(scope="module")
def views():
    seq, model = user_model()
    return seq, model, js.models.as_stack(model)


def test_the_streamed_executor_names_view_stack(tmp_path, views):
    seq, model, view = views
    store = LayerStore.create(str(tmp_path / "s"), view.params(model.init(None)),
                              optimizer=optax.sgd(0.1))
    for wrong, says in ((view, "got a StackView"), (model, "got Sequential"),
                        (seq, "an nnx module (Sequential)")):
        with pytest.raises(TypeError, match="view.stack") as e:
            StreamedExecutor(wrong, js.grad.backprop(), optax.sgd(0.1), store)
        assert says in str(e.value)
    # the right argument runs on the same store
    StreamedExecutor(view.stack, js.grad.backprop(), optax.sgd(0.1), store).close()


def test_the_pipeline_names_view_stack_and_view_params(views):
    _, model, view = views
    with pytest.raises(TypeError, match=r"got a StackView.*view\.stack"):
        pipeline(view, complete(2, 4, (0, 1)))
    pipe = pipeline(view.stack, complete(2, 4, (0, 1)))
    batch = {"x": jax.random.normal(jax.random.key(0), (4, 8, 8)),
             "y": jnp.zeros((4, 8), jnp.int32)}
    with pytest.raises(TypeError, match=r"params.*got a tuple.*view\.params\(params\)"):
        pipe(model.init(None), batch, jax.random.key(1))
    loss, grads, _ = pipe(view.params(model.init(None)), batch, jax.random.key(1))
    assert jnp.isfinite(loss) and set(grads) == {"embed", "blocks", "head"}
