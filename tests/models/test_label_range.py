"""Cross-entropy labels outside ``[0, num_classes)`` are refused by the estimators' argument
checks where the labels are concrete, naming ``batch['y']``, the label and the allowed range:
-1 would silently read the last class and ``num_classes`` give nan. The number of classes is
known where the model states it (a sequential model ending in an ``nnx.Linear``, the zoo
stacks, the views of such a model); elsewhere only negative labels are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxstream as js
import jaxstream.grad as jg
from jaxstream.models.sequential import from_sequential

ESTIMATORS = {"backprop": jg.backprop(), "forward": jg.forward(2), "hybrid": jg.hybrid(1)}


def linear_head():
    rngs = nnx.Rngs(0)
    return from_sequential(nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.tanh,
                                          nnx.Linear(16, 10, rngs=rngs)))


def batch_of(label, micro: bool, n: int = 4):
    x = jax.random.normal(jax.random.key(0), (n, 8))
    b = {"x": x, "y": jnp.full((n,), label, jnp.int32)}
    return jax.tree.map(lambda a: a.reshape(2, n // 2, *a.shape[1:]), b) if micro else b


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("label", [-1, 10])
def test_a_label_outside_the_classes_is_refused_by_name(name, label):
    model = linear_head()
    assert model.num_classes == 10
    data = batch_of(label, micro=name == "hybrid")
    with pytest.raises(ValueError, match=rf"^{name}: batch\['y'\] holds the label {label}; "
                                         r"cross-entropy needs class labels in \[0, 10\)") as err:
        ESTIMATORS[name](model, model.init(None), data, jax.random.key(0))
    assert "\n" not in str(err.value)
    ok = batch_of(9, micro=name == "hybrid")
    assert np.isfinite(float(ESTIMATORS[name](model, model.init(None), ok, jax.random.key(0))[0]))


def test_host_labels_and_zoo_stacks_are_checked_too():
    stack = js.models.mlp(8, 16, 1, 10)
    assert stack.num_classes == 10 and js.models.char_transformer(vocab=12).num_classes == 12
    data = {"x": np.zeros((4, 8), np.float32), "y": np.array([0, 3, 10, 1], np.int32)}
    with pytest.raises(ValueError, match=r"^backprop: batch\['y'\] holds the label 10; .*"
                                         r"\[0, 10\)"):
        jg.backprop()(stack, stack.init(jax.random.key(0)), data, jax.random.key(0))


def test_a_view_knows_the_models_classes():
    rngs = nnx.Rngs(0)
    model = from_sequential(nnx.Sequential(
        nnx.Linear(8, 8, rngs=rngs), *[nnx.Linear(8, 8, rngs=rngs) for _ in range(3)],
        nnx.Linear(8, 5, rngs=rngs)))
    assert js.models.as_stack(model).stack.num_classes == 5
    assert js.models.as_padded_stack(model, jnp.zeros((2, 8))).stack.num_classes == 5


def test_without_a_known_number_of_classes_only_negative_labels_are_refused():
    rngs = nnx.Rngs(0)
    model = from_sequential([nnx.Linear(8, 10, rngs=rngs), lambda h: h * 2.0])
    assert model.num_classes is None
    params = model.init(None)
    with pytest.raises(ValueError, match=r"^backprop: batch\['y'\] holds the label -1; "
                                         r"cross-entropy needs class labels in 0 and above"):
        jg.backprop()(model, params, batch_of(-1, micro=False), jax.random.key(0))
    jg.backprop()(model, params, batch_of(10, micro=False), jax.random.key(0))  # not known


def test_traced_labels_are_not_checked():
    """Inside jit the labels have no values yet: the check is for concrete labels only."""
    model = linear_head()
    loss = jax.jit(lambda b: jg.backprop()(model, model.init(None), b)[0])(batch_of(9, False))
    assert np.isfinite(float(loss))
