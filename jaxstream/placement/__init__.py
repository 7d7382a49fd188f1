"""Placement of pipeline stages on devices of different speeds."""

from jaxstream.placement.stages import (
    Placement,
    evaluate_placement,
    measure_layer_costs,
    place_stages,
    uniform_placement,
)

__all__ = [
    "Placement", "evaluate_placement", "measure_layer_costs", "place_stages",
    "uniform_placement",
]  # fmt: skip
