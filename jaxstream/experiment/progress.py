"""What a run shows on the terminal while it works: status lines and per-arm progress bars.

Status lines go to stderr (``jaxstream: loading data ...``) so a long silent phase -- loading
data, compiling the first step -- says what it is doing. A bar stays on screen when its arm is
done, and each arm ends with one line of its final figures.

Example:
    >>> status("loading data (digits)")
    >>> bar = arm_bar(range(300), "backprop", start=0, total=300, enabled=True)
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

#: Set to False to silence status lines (tests, library use); bars follow ``progress:``.
ENABLED = True


def status(text: str) -> None:
    """Print one status line to stderr now (flushed)."""
    if ENABLED:
        print(f"jaxstream: {text} ...", file=sys.stderr, flush=True)


def arm_bar(steps: Iterable[int], arm: str, *, start: int, total: int, enabled: bool) -> Any:
    """A tqdm bar over an arm's steps that stays on screen when the arm is done."""
    return tqdm(steps, desc=arm, initial=start, total=total, leave=True,
                disable=None if enabled else True, dynamic_ncols=True)


def arm_done(arm: str, record: dict | None, enabled: bool = True) -> None:
    """One closing line per arm: its last step, loss and test accuracy."""
    if not (ENABLED and enabled and record):
        return
    parts = [f"step {record.get('step')}"]
    for key, label in (("loss", "loss"), ("test_accuracy", "test acc")):
        if record.get(key) is not None:
            parts.append(f"{label} {record[key]:.3f}")
    print(f"{arm}: done, " + ", ".join(parts), file=sys.stderr, flush=True)
