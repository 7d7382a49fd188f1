"""Placement of pipeline stages on devices of different speeds."""

from jaxstream.placement.by_type import TypeAssignment, assign_by_type, measure_kind_speeds
from jaxstream.placement.stages import (
    Placement,
    evaluate_placement,
    evaluate_split,
    measure_layer_costs,
    place_by_type,
    place_stages,
    type_times,
    uniform_placement,
)

__all__ = [
    "Placement", "TypeAssignment", "assign_by_type", "evaluate_placement", "evaluate_split",
    "measure_kind_speeds", "measure_layer_costs", "place_by_type", "place_stages", "type_times",
    "uniform_placement",
]  # fmt: skip
