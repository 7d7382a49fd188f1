"""What a run shows on the terminal while it works: status lines and per-arm progress bars.

Status lines go to stderr (``jaxstream: loading data ...``) so a long silent phase -- loading
data, compiling the first step -- says what it is doing. A bar stays on screen when its arm is
done, and each arm ends with one line of its final figures.

Example:
    >>> status("loading data (digits)")
    >>> bar = arm_bar("backprop", start=0, total=300, enabled=True)
    >>> loop.add_hook(bar_hook(bar))                  # advance it every step
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

#: Set to False to silence status lines (tests, library use); bars follow ``progress:``.
ENABLED = True


def status(text: str) -> None:
    """Print one status line to stderr now (flushed)."""
    if ENABLED:
        print(f"jaxstream: {text} ...", file=sys.stderr, flush=True)


def arm_bar(arm: str, *, start: int, total: int, enabled: bool, leave: bool = True) -> Any:
    """A tqdm bar of an arm's steps (at ``start`` of ``total``); by default it stays on screen
    when the arm is done."""
    return work_bar(None, arm, enabled=enabled, leave=leave, initial=start, total=total)


def work_bar(items: Any, desc: str, *, enabled: bool = True, leave: bool = False,
             **kw: Any) -> Any:
    """A tqdm bar over ``items``, shown only on a terminal (tqdm's ``disable=None``) and when
    ``enabled``, so a redirected run's output holds no bar; ``kw``: tqdm's own."""
    return tqdm(items, desc=desc, leave=leave, disable=None if enabled else True,
                dynamic_ncols=True, **kw)


def bar_hook(bar: Any) -> Callable[[Any], None]:
    """A training-loop hook (run it every step, after evaluation) that advances ``bar`` and shows
    the loss and test accuracy of steps that were evaluated."""

    def advance(info: Any) -> None:
        bar.update(1)
        r = info.record
        if isinstance(r.get("test_accuracy"), float) and isinstance(r.get("loss"), float):
            bar.set_postfix(loss=f"{r['loss']:.3f}", test_acc=f"{r['test_accuracy']:.3f}")

    return advance


def arm_done(arm: str, record: dict | None, enabled: bool = True,
             stopped_at: int | None = None, steps: int | None = None) -> None:
    """One closing line per arm: its last evaluation's step, test loss and test accuracy (the
    table's figures), and, for a run stopped by ``max_steps``, that it stopped and how to go on."""
    if not (ENABLED and enabled and record):
        return
    parts = [f"step {record.get('step')}"]
    for key, label in (("test_loss", "test loss"), ("test_accuracy", "test acc")):
        if record.get(key) is not None:
            parts.append(f"{label} {record[key]:.3f}")
    head = "done" if stopped_at is None else (
        f"stopped at step {stopped_at} of {steps} (max_steps; continue with --resume)")
    print(f"{arm}: {head}, " + ", ".join(parts), file=sys.stderr, flush=True)
