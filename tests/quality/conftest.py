"""The gradient-quality lab's tests run with strict dtype promotion, as the estimator core's do
(tests/grad/conftest.py): an implicit upcast in a measure fails loudly. A test that trains
through optax opts out with ``@pytest.mark.standard_promotion`` (optax's own bias correction
raises a Python float to an int32 count, which strict promotion refuses)."""

import jax
import pytest


@pytest.fixture(autouse=True)
def strict_dtype_promotion(request):
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield
