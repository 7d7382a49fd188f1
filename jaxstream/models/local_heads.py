"""A stack whose embed and blocks each carry their own local head (Ren et al., ICLR 2023).

Local losses (``forward(perturb="activations", local_losses=True)``, LG-FG-A, and
``local_forward_weights``, LG-FG-W) apply, by default, the model's final head to every block's
output, held fixed: a *shared-head* design. Ren et al. instead give every block a head of its
own, learned by the exact gradient of its local loss. :func:`with_local_heads` builds that
model from any stack: ``params["embed"]`` and ``params["blocks"]`` become
``{"module": ..., "local_head": ...}``, each local head shaped as the final head and
initialised afresh. The model's output and loss are unchanged (local heads are read by local
losses only), so every other estimator trains it as before; its local heads then get zero
gradient (backprop) or zero-mean noise (weight perturbation).

Example:
  >>> stack = with_local_heads(mlp(in_dim=40, width=100, depth=1, num_classes=10))
  >>> params = stack.init(jax.random.key(0))
  >>> loss, grads = forward(perturb="activations", local_losses=True)(stack, params, batch, key)
"""

from __future__ import annotations

import dataclasses

import jax

from jaxstream.models.stack import Stack

LOCAL = 0x10CA1  # key segment of the local heads' initialisation


def with_local_heads(stack: Stack) -> Stack:
    """``stack`` with a local head of the final head's shape on the embed and on every block.

    Raises:
      ValueError: ``stack`` already has local heads, or its head does not read every block's
        output (a padded stack).
    """
    if not isinstance(stack, Stack):
        raise TypeError(f"with_local_heads: needs a model Stack, got {type(stack).__name__}")
    if stack.local_head is not None:
        raise ValueError(f"with_local_heads: {stack.name!r} already has local heads")
    if not stack.shared_head:
        raise ValueError(f"with_local_heads: {stack.name!r}'s head reads only the last block's "
                         "output (a padded stack), so a head of its shape cannot read the others")
    heads = jax.jit(jax.vmap(lambda k: stack.init(k)["head"]))

    def init(key: jax.Array) -> dict:
        params = stack.init(key)
        own = heads(jax.random.split(jax.random.fold_in(key, LOCAL), stack.num_layers + 1))
        first = jax.tree.map(lambda a: a[0], own)
        rest = jax.tree.map(lambda a: a[1:], own)
        return {"embed": {"module": params["embed"], "local_head": first},
                "blocks": {"module": params["blocks"], "local_head": rest},
                "head": params["head"]}

    return dataclasses.replace(
        stack, embed=lambda p, x: stack.embed(p["module"], x),
        block=lambda p, h: stack.block(p["module"], h), init=init, local_head=stack.head,
        name=f"{stack.name}+local heads")
