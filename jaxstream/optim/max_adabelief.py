"""Max-AdaBelief: AdaBelief whose second moment is replaced by its running maximum.

AdaBelief (Zhuang et al., 2020) scales the step by the "belief" s_t, an exponential
average of (g_t - m_t)^2.  Max-AdaBelief keeps the running maximum of s_t, as AMSGrad
does for Adam, so the effective step size never grows back after a noisy stretch.
With ``use_max=False`` every operation is the one of ``optax.scale_by_belief``, in the
same order, so the result equals ``optax.adabelief`` bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax._src import numerics

__all__ = ["MAX_OF", "ScaleByMaxBeliefState", "max_adabelief", "scale_by_max_belief"]

MAX_OF = ("raw", "corrected")


class ScaleByMaxBeliefState(NamedTuple):
    """State of :func:`scale_by_max_belief`.

    ``nu`` is the current belief s_t; ``nu_max`` its running maximum (equal to ``nu``
    when the maximum is switched off).
    """

    count: jax.Array  # shape (), int32
    mu: optax.Updates
    nu: optax.Updates
    nu_max: optax.Updates


def scale_by_max_belief(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    *,
    use_max: bool = True,
    max_of: str = "raw",
    nesterov: bool = False,
) -> optax.GradientTransformation:
    """Rescale updates by Max-AdaBelief (no learning rate; see :func:`max_adabelief`).

    m_t = b1 m + (1-b1) g;  s_t = b2 s + (1-b2)(g - m_t)^2 + eps_root;
    s^max_t = max(s^max_{t-1}, s_t);  u = m_t/(1-b1^t) / (sqrt(s^max_t/(1-b2^t)) + eps).
    With ``max_of="corrected"`` the maximum is taken over the bias-corrected s_t/(1-b2^t)
    instead (as ``optax.amsgrad`` does): the raw s_t grows from 0 for about 1/(1-b2) steps,
    so a maximum of raw values rarely binds early in training, a corrected one can.

    Args:
      b1: decay of the first moment.
      b2: decay of the belief (second central moment).
      eps: added to the denominator, outside the square root.
      eps_root: added to the belief at every step, inside the square root.
      use_max: keep the running maximum of the belief; ``False`` gives AdaBelief.
      max_of: ``"raw"`` (max of s_t, then bias correction) or ``"corrected"`` (max of the
        bias-corrected s_t).
      nesterov: Nesterov momentum, as in ``optax.scale_by_belief``.

    Returns:
      An ``optax.GradientTransformation``.

    Example:
      >>> tx = scale_by_max_belief()
      >>> state = tx.init({"w": jnp.zeros(3)})
    """

    if max_of not in MAX_OF:
        raise ValueError(f"max_of: {max_of!r} is not allowed; choose one of {MAX_OF}")
    _check_hyper(b1=b1, b2=b2, eps=eps, eps_root=eps_root)
    corrected = use_max and max_of == "corrected"

    def init_fn(params: optax.Params) -> ScaleByMaxBeliefState:
        zeros = optax.tree.zeros_like(params)
        return ScaleByMaxBeliefState(
            count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros, nu_max=zeros
        )

    def update_fn(updates, state: ScaleByMaxBeliefState, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        prediction_error = optax.tree.sub(updates, mu)
        nu = optax.tree.update_moment_per_elem_norm(prediction_error, state.nu, b2, 2)
        nu = jax.tree.map(lambda v: v + eps_root, nu)
        count_inc = numerics.safe_increment(state.count)
        if corrected:
            nu_max = jax.tree.map(
                jnp.maximum, state.nu_max, _bias_correction(nu, b2, count_inc)
            )
        elif use_max:
            nu_max = jax.tree.map(jnp.maximum, state.nu_max, nu)
        else:
            nu_max = nu
        mu_hat = first_moment_hat(mu, updates, count_inc, b1, nesterov)
        updates = belief_step(mu_hat, nu_max, count_inc, b2, eps, corrected)
        return updates, ScaleByMaxBeliefState(count=count_inc, mu=mu, nu=nu, nu_max=nu_max)

    return optax.GradientTransformation(init_fn, update_fn)


def _bias_correction(moment: Any, decay: float, count: jax.Array) -> Any:
    """optax's bias correction, whose ``decay ** count`` (a Python float to an int32 count)
    follows standard dtype promotion even where the caller runs strict."""
    with jax.numpy_dtype_promotion("standard"):
        return optax.tree.bias_correction(moment, decay, count)


def first_moment_hat(mu: Any, updates: Any, count: jax.Array, b1: float,
                     nesterov: bool) -> Any:
    """The bias-corrected first moment m̂ after ``count`` steps (Nesterov: as optax's)."""
    if not nesterov:
        return _bias_correction(mu, b1, count)
    return jax.tree.map(
        lambda m, g: b1 * m + (1 - b1) * g,
        _bias_correction(mu, b1, numerics.safe_increment(count)),
        _bias_correction(updates, b1, count),
    )


def belief_step(m_hat: Any, nu_max: Any, count: jax.Array, b2: float, eps: float,
                corrected: bool) -> Any:
    """m̂ / (√ŝ + ε), with ŝ the bias-corrected running maximum (already corrected when the
    maximum is taken of corrected values)."""
    nu_hat = nu_max if corrected else _bias_correction(nu_max, b2, count)
    return jax.tree.map(
        lambda m, v: None if m is None else m / (jnp.sqrt(v) + eps),
        m_hat,
        nu_hat,
        is_leaf=lambda x: x is None,
    )


def _check_hyper(**values: Any) -> None:
    """Decays in [0, 1) (b2 = 1 never updates the belief from 0: every step divides by eps
    alone, or is 0/0 with bias correction), epsilons >= 0; each named. Traced values pass."""
    for name, v in values.items():
        if isinstance(v, jax.core.Tracer) or jnp.ndim(v):
            continue
        v = float(v)
        if name.startswith("b") and not 0.0 <= v < 1.0:
            raise ValueError(f"max_adabelief: {name} must be in [0, 1), got {v!r}")
        if name.startswith("eps") and not v >= 0.0:
            raise ValueError(f"max_adabelief: {name} must be >= 0, got {v!r}")


def max_adabelief(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-16,
    eps_root: float = 1e-16,
    *,
    use_max: bool = True,
    max_of: str = "raw",
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """The Max-AdaBelief optimizer: :func:`scale_by_max_belief` chained with a learning rate.

    Arguments and defaults are those of ``optax.adabelief``; ``use_max=False`` makes it
    exactly ``optax.adabelief``.

    Args:
      learning_rate: a float or an optax schedule.
      b1, b2, eps, eps_root, nesterov: as in ``optax.adabelief``.
      use_max: keep the running maximum of the belief (the point of this optimizer).
      max_of: ``"raw"`` or ``"corrected"``: see :func:`scale_by_max_belief`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> opt = max_adabelief(1e-3)
      >>> state = opt.init(params)
      >>> updates, state = opt.update(grads, state, params)
      >>> params = optax.apply_updates(params, updates)

    References:
      Zhuang et al., AdaBelief Optimizer, https://arxiv.org/abs/2010.07468 (2020);
      Reddi et al., On the Convergence of Adam and Beyond (AMSGrad), ICLR 2018.
    """
    return optax.chain(
        scale_by_max_belief(
            b1=b1,
            b2=b2,
            eps=eps,
            eps_root=eps_root,
            use_max=use_max,
            max_of=max_of,
            nesterov=nesterov,
        ),
        optax.scale_by_learning_rate(learning_rate),
    )
