"""The forward passes, as objects that declare what an engine must carry to run them.

A :class:`~jaxstream.grad.plan.Plan` names its forward pass; :func:`get` returns the
:class:`ForwardPass` that name stands for. Engines read its declarations — where the tangents
sit, whether each block has a loss of its own, whether the estimate is the per-tangent scalars
on the weights' keys, whether a guess comes first — and the engines it runs on, and refuse by
them; no engine compares a pass's name.

Example:
  >>> get("local_weights").local_losses, get("local_weights").tangents
  (True, 'weights')
  >>> get("zeroth_order").runs_on("stream")
  False
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Engine = Literal["memory", "data_parallel", "pipeline", "stream", "composed"]
ENGINES: tuple[Engine, ...] = ("memory", "data_parallel", "pipeline", "stream", "composed")
_EVERYWHERE = frozenset(ENGINES)


@dataclasses.dataclass(frozen=True)
class ForwardPass:
    """One forward pass and its declared needs.

    Attributes:
      name: the plan's name for it (``Plan.forward``).
      label: how a table names it (``forward(<label>, K=1)``).
      tangents: where its tangents sit: ``"weights"``, ``"activations"`` or None (no jvp).
      local_losses: each block (or group) is trained on a loss of its own (local heads).
      guess: one jvp along a direction the pass forms first (the local losses' exact
        gradients), so a stage or a streamed unit runs two sweeps.
      engines: the engines that run it (the rest refuse it by name).
    """

    name: str
    label: str
    tangents: Literal["weights", "activations"] | None
    local_losses: bool = False
    guess: bool = False
    engines: frozenset[str] = _EVERYWHERE

    def __post_init__(self):
        unknown = set(self.engines) - set(ENGINES)
        if unknown:
            raise ValueError(f"engines: {sorted(unknown)} are not engines; allowed: {ENGINES}")

    @property
    def runs(self) -> bool:
        """A forward pass runs at all (``"none"``: exact gradients only)."""
        return self.name != "none"

    @property
    def scalars(self) -> bool:
        """The estimate is Σ_k d_k v_k with v_k drawn from the weights' keys: K scalars and a
        key describe it (exchanged as scalars, replayed lazily, mixed with exact gradients)."""
        return self.tangents == "weights" and not self.local_losses

    @property
    def forms_block_estimates(self) -> bool:
        """Each block's estimate is formed by the pass itself, block by block (activity
        tangents, local losses), not from one global directional derivative."""
        return self.tangents == "activations" or (self.local_losses and not self.guess)

    def runs_on(self, engine: str) -> bool:
        """Whether ``engine`` runs this pass."""
        return engine in self.engines

    def refuse_unless(self, engine: str, who: str, describe: str) -> None:
        """Raises ValueError naming the pass, ``engine`` and the passes it runs, unless
        ``engine`` runs this pass; ``who`` prefixes the message, ``describe`` names the
        estimator."""
        if not self.runs_on(engine):
            ran = carried_by(engine)
            raise ValueError(f"{who}: {describe} needs a {self.name!r} forward pass, which "
                             f"the {engine} engine does not run (it runs {ran}); run it in "
                             f"memory or data parallel")


_PASSES: dict[str, ForwardPass] = {}


def register(fp: ForwardPass) -> ForwardPass:
    """Adds a forward pass (a name is taken once); an engine runs it where it declares that
    engine (and the engine's kernels for its declarations exist)."""
    if not isinstance(fp, ForwardPass):
        raise TypeError(f"register: a ForwardPass, got {type(fp).__name__}")
    if fp.name in _PASSES:
        raise ValueError(f"forward pass {fp.name!r} is already registered")
    _PASSES[fp.name] = fp
    return fp


def get(name: str) -> ForwardPass:
    """The forward pass ``name``; ValueError naming the registered ones otherwise."""
    if name not in _PASSES:
        raise ValueError(f"plan.forward: {name!r}; allowed: {names()}")
    return _PASSES[name]


def names() -> tuple[str, ...]:
    """The registered passes' names, in registration order."""
    return tuple(_PASSES)


def carried_by(engine: str) -> tuple[str, ...]:
    """The names of the passes ``engine`` runs."""
    return tuple(n for n, fp in _PASSES.items() if fp.runs_on(engine))


for _fp in (
    ForwardPass("none", "none", None),
    ForwardPass("weights", "weights", "weights"),
    ForwardPass("activity", "activations", "activations"),
    ForwardPass("local", "local activations", "activations", local_losses=True),
    ForwardPass("local_weights", "local weights", "weights", local_losses=True),
    # two sweeps per step: exact local gradients, then one jvp along them (a streamed
    # placement declares whether it runs them: ``runs_local_guess``)
    ForwardPass("local_guess", "local guess", "weights", local_losses=True, guess=True),
    # no jvp: two loss evaluations per direction, formed by the pass itself
    ForwardPass("zeroth_order", "spsa", None,
                engines=frozenset({"memory", "data_parallel"})),
):
    register(_fp)
