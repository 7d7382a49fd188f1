"""Pipeline parallelism for forward-gradient training: schedule tables and the shard_map executor.

Schedules are plain NumPy tables (the table modules never import JAX): build one with a
generator, check it with `validate`, measure it with the metrics, draw it with `render_text` /
`render_png`. `pipeline(stack, schedule, ...)` runs any valid table with shard_map.

Example:
  >>> from jaxstream.pipeline import complete, pipeline
  >>> pipe = pipeline(stack, complete(4, 8, (0, 1)), num_tangents=4)
  >>> loss, grads, aux = pipe(params, micro_batches, key)
"""

from jaxstream.pipeline.cross_step import (
    crossstep,
    max_coverage,
    max_full_chains,
    min_added_ticks,
)
from jaxstream.pipeline.executor import Pipeline, PipelineCarry, pipeline
from jaxstream.pipeline.generators import (
    POLICIES,
    check_selected,
    complete,
    delayed,
    gpipe_backprop,
    gpipe_forward,
    make_schedule,
    one_f_one_b,
    truncated,
)
from jaxstream.pipeline.listsched import best_list_schedule, list_schedule
from jaxstream.pipeline.lowering import Lowered, exact_from, lower
from jaxstream.pipeline.metrics import (
    OpCosts,
    coverage,
    coverage_per_stage,
    fill_ratio,
    forward_only_idle_mask,
    gpipe_idle_fraction,
    groups,
    groups_nested,
    idle_fraction,
    makespan,
    staleness_per_stage,
    summary,
    weighted_makespan,
)
from jaxstream.pipeline.render import render_png, render_text
from jaxstream.pipeline.table import BW, FBW, IDLE, OP_NAMES, B, F, Schedule, W
from jaxstream.pipeline.unequal import unequal_stages
from jaxstream.pipeline.validate import ScheduleError, peak_stash, stash_intervals, validate

__all__ = [
    "BW",
    "FBW",
    "IDLE",
    "OP_NAMES",
    "POLICIES",
    "B",
    "F",
    "Lowered",
    "OpCosts",
    "Pipeline",
    "PipelineCarry",
    "Schedule",
    "ScheduleError",
    "W",
    "best_list_schedule",
    "check_selected",
    "complete",
    "coverage",
    "coverage_per_stage",
    "crossstep",
    "delayed",
    "exact_from",
    "fill_ratio",
    "forward_only_idle_mask",
    "gpipe_backprop",
    "gpipe_forward",
    "gpipe_idle_fraction",
    "groups",
    "groups_nested",
    "idle_fraction",
    "list_schedule",
    "lower",
    "make_schedule",
    "makespan",
    "max_coverage",
    "max_full_chains",
    "min_added_ticks",
    "one_f_one_b",
    "peak_stash",
    "pipeline",
    "render_png",
    "render_text",
    "staleness_per_stage",
    "stash_intervals",
    "summary",
    "truncated",
    "unequal_stages",
    "validate",
    "weighted_makespan",
]
