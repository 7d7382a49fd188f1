"""Pipeline parallelism for forward-gradient training: schedule tables and the shard_map executor.

Schedules are plain NumPy tables (no JAX): build one with a generator, check it with `validate`,
measure it with the metrics, draw it with `render_text` / `render_png`.
"""

from jaxstream.pipeline.generators import (
    POLICIES, check_selected, complete, delayed, gpipe_backprop, gpipe_forward, make_schedule,
    one_f_one_b, truncated,
)
from jaxstream.pipeline.listsched import best_list_schedule, list_schedule
from jaxstream.pipeline.metrics import (
    OpCosts, coverage, fill_ratio, forward_only_idle_mask, gpipe_idle_fraction, groups,
    groups_nested, idle_fraction, makespan, summary, weighted_makespan,
)
from jaxstream.pipeline.render import render_png, render_text
from jaxstream.pipeline.table import B, BW, F, FBW, IDLE, OP_NAMES, W, Schedule
from jaxstream.pipeline.validate import ScheduleError, peak_stash, stash_intervals, validate

__all__ = [
    "B", "BW", "F", "FBW", "IDLE", "OP_NAMES", "W", "POLICIES", "OpCosts", "Schedule",
    "ScheduleError", "best_list_schedule", "check_selected", "complete", "coverage", "delayed",
    "fill_ratio", "forward_only_idle_mask", "gpipe_backprop", "gpipe_forward",
    "gpipe_idle_fraction", "groups", "groups_nested", "idle_fraction", "list_schedule",
    "make_schedule", "makespan", "one_f_one_b", "peak_stash", "render_png", "render_text",
    "stash_intervals", "summary", "truncated", "validate", "weighted_makespan",
]
