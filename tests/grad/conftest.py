"""The estimator core's tests run with strict dtype promotion (as equinox's do): an implicit
upcast (int with float, bf16 with fp32) inside an estimator fails loudly instead of silently
changing precision."""

import jax
import pytest


@pytest.fixture(autouse=True)
def strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield
