"""Data-parallel Max-AdaBelief that exchanges moments instead of gradients.

Each replica of a ``data`` mesh axis runs the Max-AdaBelief recursion on its *own* gradient
g_i (its own m_i, s_i, s^max_i), then the replicas average the bias-corrected first moment
m̂_i and the running maximum of the belief s^max_i, and every replica applies the same update

    u = mean_i(m̂_i) / (sqrt(mean_i(ŝ^max_i)) + eps),   ŝ^max_i = s^max_i / (1 - b2^t)

(``max_of="corrected"``: s^max_i is already corrected).  The recursion is nonlinear in g, so
this is not Max-AdaBelief of the averaged gradient: each s_i measures the noise of its own
replica's gradients, and a mean of moments is not the moment of the mean.  When every replica
sees the same gradient the two coincide.

State: the per-replica state is exactly :class:`~jaxstream.optim.ScaleByMaxBeliefState`
(count, m_i, s_i, s^max_i) and stays per replica: it is *not* replaced by the averages, so
the replicas' states differ while their parameters (and updates) are the same.  A checkpoint
must hold every replica's state (n copies), e.g. the stacked state of ``shard_map`` with
``P("data")``; restoring one replica's state into all changes the run.  The ``dataparallel``
engine does this with ``exchange: moments`` (:meth:`jaxstream.comm.DataParallel.step`).

Wire: two params-sized all-reduces per step (m̂ and ŝ^max, sent as one bucket) against one
for a gradient all-reduce.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxstream.comm.ring import ring_all_reduce_tree
from jaxstream.optim.max_adabelief import (
    ScaleByMaxBeliefState,
    belief_step,
    first_moment_hat,
    scale_by_max_belief,
)

__all__ = ["ALLREDUCE", "max_adabelief_exchange", "scale_by_max_belief_exchange"]

ALLREDUCE = ("psum", "ring")


def _mean(tree: Any, axis_name: str, allreduce: str) -> Any:
    if allreduce == "ring":
        return ring_all_reduce_tree(tree, axis_name, mean=True)
    return jax.lax.pmean(tree, axis_name)


def scale_by_max_belief_exchange(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    *,
    use_max: bool = True,
    max_of: str = "raw",
    nesterov: bool = False,
    axis_name: str = "data",
    allreduce: str = "psum",
) -> optax.GradientTransformation:
    """Max-AdaBelief per replica with m̂ and s^max averaged over ``axis_name`` (no learning rate).

    Call ``update`` inside ``shard_map`` (or ``pmap``) over ``axis_name`` with this replica's
    gradient and state; see :func:`max_adabelief_exchange`.

    Args:
      b1, b2, eps, eps_root, use_max, max_of, nesterov: as in
        :func:`~jaxstream.optim.scale_by_max_belief` (``use_max=False``: AdaBelief, the
        belief s_i itself is averaged).
      axis_name: the data-parallel mesh axis.
      allreduce: ``"psum"`` (XLA's mean all-reduce) or ``"ring"``
        (:func:`~jaxstream.comm.ring_all_reduce_tree`, one bucket for m̂ and s^max).

    Returns:
      An ``optax.GradientTransformation`` whose state is this replica's
      ``ScaleByMaxBeliefState``.

    Example:
      >>> tx = scale_by_max_belief_exchange(axis_name="data", allreduce="ring")
    """
    if allreduce not in ALLREDUCE:
        raise ValueError(f"allreduce: {allreduce!r} is not allowed; choose one of {ALLREDUCE}")
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name: expected a mesh axis name (str), got {axis_name!r}")
    local = scale_by_max_belief(
        b1, b2, eps, eps_root, use_max=use_max, max_of=max_of, nesterov=nesterov
    )
    corrected = use_max and max_of == "corrected"

    def update_fn(updates, state: ScaleByMaxBeliefState, params=None):
        # This replica's recursion; its own update is discarded (and compiled away).
        _, state = local.update(updates, state, params)
        m_hat = first_moment_hat(state.mu, updates, state.count, b1, nesterov)
        m_hat, s_max = _mean((m_hat, state.nu_max), axis_name, allreduce)
        return belief_step(m_hat, s_max, state.count, b2, eps, corrected), state

    return optax.GradientTransformation(local.init, update_fn)


def max_adabelief_exchange(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    *,
    use_max: bool = True,
    max_of: str = "raw",
    nesterov: bool = False,
    axis_name: str = "data",
    allreduce: str = "psum",
) -> optax.GradientTransformationExtraArgs:
    """Data-parallel Max-AdaBelief exchanging m̂ and s^max: per-replica recursion, shared update.

    Use inside ``shard_map`` over ``axis_name``: params replicated (``P()``), this replica's
    gradient (of its batch shard, *not* all-reduced) and its own optimizer state (stacked
    over replicas with ``P("data")`` outside the map).  Every replica returns the same
    updates; the states stay per replica (checkpoint all of them).

    Args:
      learning_rate: a float or an optax schedule.
      b1, b2, eps, eps_root, use_max, max_of, nesterov: as in
        :func:`~jaxstream.optim.max_adabelief`.
      axis_name: the data-parallel mesh axis.
      allreduce: ``"psum"`` or ``"ring"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> opt = max_adabelief_exchange(1e-3, allreduce="ring")
      >>> states = jax.tree.map(lambda x: jnp.stack([x] * n), opt.init(params))
      >>> def body(params, state, batch):           # inside shard_map over "data"
      ...     state = jax.tree.map(lambda x: x[0], state)
      ...     grads = jax.grad(loss)(params, batch)  # this replica's shard only
      ...     updates, state = opt.update(grads, state, params)
      ...     return optax.apply_updates(params, updates), jax.tree.map(lambda x: x[None], state)

    References:
      Zhuang et al., AdaBelief Optimizer, https://arxiv.org/abs/2010.07468 (2020).
    """
    return optax.chain(
        scale_by_max_belief_exchange(
            b1,
            b2,
            eps,
            eps_root,
            use_max=use_max,
            max_of=max_of,
            nesterov=nesterov,
            axis_name=axis_name,
            allreduce=allreduce,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )
