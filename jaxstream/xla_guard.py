"""A guard against a known miscompilation of XLA's CPU backend in jaxlib 0.10.2.

XLA hands some fused reductions to YNNPACK on the CPU, and there (jaxlib 0.10.2) a jitted,
vmapped reduction returns wrong values past a batch size: jax-ml/jax#39103 (a vmapped
matrix-vector product summed, wrong from 32 769 rows), and one found here: the pullback of a
layer norm (``x * rsqrt(mean(x²))``) vmapped over cotangents, every row from the 64th on wrong
by O(1). That is the pattern of every unbiasedness check and every K-tangent jvp with the
primal held fixed. ``--xla_cpu_experimental_ynn_fusion_type=-reduce`` keeps reductions out of
YNNPACK and gives the right values in both.

``import jaxstream`` adds that flag to ``XLA_FLAGS`` when JAX's backends are not yet running
and the jaxlib is one that knows the flag (XLA aborts on a flag it does not know); it warns,
naming the flag, when they are already running without it. :func:`miscompiles` runs the
layer-norm reproducer in this process.

Example:
  >>> import jaxstream.xla_guard as g
  >>> g.miscompiles()   # False once the guard is in place
  False
"""

from __future__ import annotations

import os
import warnings

FLAG = "--xla_cpu_experimental_ynn_fusion_type=-reduce"
_KNOWN = ((0, 10, 2), (0, 12, 0))  # jaxlib versions that have the flag: [first, last)


def _version(text: str) -> tuple[int, ...]:
    import re

    return tuple(int(m.group()) if (m := re.match(r"\d+", piece)) else 0
                 for piece in text.split(".")[:3])


def _jaxlib_version() -> tuple[int, ...] | None:
    from importlib import metadata

    try:
        return _version(metadata.version("jaxlib"))
    except metadata.PackageNotFoundError:
        return None


def flag_applies(version: tuple[int, ...] | None) -> bool:
    """Whether a jaxlib of ``version`` knows :data:`FLAG` (and so may need it)."""
    return version is not None and _KNOWN[0] <= version < _KNOWN[1]


def install() -> str:
    """Add :data:`FLAG` to ``XLA_FLAGS`` before JAX starts its backends. Returns what was
    done: "set", "present" (the user's flags already name the YNN fusion), "skipped" (a jaxlib
    without the flag), or "late" (backends already running: a warning says so)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_experimental_ynn_fusion_type" in flags:
        return "present"
    if not flag_applies(_jaxlib_version()):
        return "skipped"
    if _backends_running():
        warnings.warn(
            "jaxstream: JAX's backends started before jaxstream was imported, without "
            f"{FLAG}; jaxlib 0.10.2's CPU backend miscompiles some vmapped reductions "
            "(jax-ml/jax#39103). Import jaxstream first, or set XLA_FLAGS to include it.",
            RuntimeWarning, stacklevel=3)
        return "late"
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
    return "set"


def _backends_running() -> bool:
    import sys

    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # a JAX whose private layout moved: assume the worst, say so
        return True
    return bool(xla_bridge.backends_are_initialized())


def miscompiles() -> bool:
    """Run the layer-norm reproducer (a pullback vmapped over 100 cotangents, jitted) in this
    process: True where a row differs from its own unbatched pullback by more than 1e-3."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 16, 2, 4)), jnp.float32)
    _, pull = jax.vjp(lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True)), x)
    cts = jnp.asarray(rng.standard_normal((100,) + x.shape), jnp.float32)
    batched = np.asarray(jax.jit(jax.vmap(pull))(cts)[0])
    last = np.asarray(pull(cts[-1])[0])
    return bool(np.max(np.abs(batched[-1] - last)) > 1e-3)
