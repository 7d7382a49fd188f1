"""Optax gradient transformations for jaxstream (Max-AdaBelief, its data-parallel exchange).

Importing the package also registers ``max_adabelief`` with the experiment runner.
"""

from jaxstream.optim.exchange import max_adabelief_exchange, scale_by_max_belief_exchange
from jaxstream.optim.max_adabelief import (
    ScaleByMaxBeliefState,
    max_adabelief,
    scale_by_max_belief,
)

__all__ = [
    "ScaleByMaxBeliefState",
    "max_adabelief",
    "max_adabelief_exchange",
    "scale_by_max_belief",
    "scale_by_max_belief_exchange",
]
