"""Reading Markdown tables in tests by their cells, not by a writer's column padding."""

from __future__ import annotations

import re


def compact(text: str) -> str:
    """``text`` with every table line's cell padding removed (``"| a  |  b |"`` ->
    ``"| a | b |"``), so that a check names cells whatever widths pandas gave the columns."""
    return "\n".join(re.sub(r"\s*\|\s*", " | ", line).strip() if line.lstrip().startswith("|")
                     else line for line in text.splitlines())
