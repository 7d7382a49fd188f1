"""Models as stacks: embed -> L blocks -> head -> loss, over a params pytree with stacked blocks."""

from jaxstream.models.nnx_stack import from_nnx, nnx_stack_factory
from jaxstream.models.stack import (
    Batch,
    Params,
    Stack,
    cross_entropy,
    is_stack_params,
    layer_slice,
    slice_blocks,
)
from jaxstream.models.zoo import char_transformer, cnn, mlp

__all__ = [
    "Batch",
    "Params",
    "Stack",
    "char_transformer",
    "cnn",
    "cross_entropy",
    "from_nnx",
    "is_stack_params",
    "layer_slice",
    "mlp",
    "nnx_stack_factory",
    "slice_blocks",
]
