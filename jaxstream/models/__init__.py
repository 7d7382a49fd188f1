"""Models as stacks (embed -> L identical blocks -> head -> loss, over a params pytree with stacked
blocks, the fast path) and as sequences of layers written as an ``nnx.Sequential``."""

from jaxstream.models.local_heads import with_local_heads
from jaxstream.models.local_mixer import local_mixer
from jaxstream.models.nnx_stack import from_nnx, nnx_stack_factory
from jaxstream.models.padded_stack import PaddedView, as_padded_stack, to_stack
from jaxstream.models.seq_stack import StackView, as_stack
from jaxstream.models.sequential import Sequential, from_sequential
from jaxstream.models.stack import (
    Batch,
    Params,
    Stack,
    cross_entropy,
    is_stack_params,
    layer_slice,
    slice_blocks,
)
from jaxstream.models.zoo import char_transformer, cnn, mixer, mlp

__all__ = [
    "Batch",
    "PaddedView",
    "Params",
    "Sequential",
    "Stack",
    "StackView",
    "as_padded_stack",
    "as_stack",
    "char_transformer",
    "cnn",
    "cross_entropy",
    "from_nnx",
    "from_sequential",
    "is_stack_params",
    "layer_slice",
    "local_mixer",
    "mixer",
    "mlp",
    "nnx_stack_factory",
    "slice_blocks",
    "to_stack",
    "with_local_heads",
]
