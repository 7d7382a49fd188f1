"""The command line and config a run was started with, as the runner recorded them."""

from __future__ import annotations

import json
from pathlib import Path


def invocation(run_dir: Path, command: str) -> tuple[str | None, str]:
    """``(config file, command line)`` of the run writing ``run_dir``, from the ``env.json``
    the runner wrote before it started (the report names both); else ``(None, command)``."""
    env = run_dir / "env.json"
    try:
        e = json.loads(env.read_text()) if env.is_file() else {}
    except ValueError:
        e = {}
    if not isinstance(e, dict) or not e.get("config"):
        return None, command
    return e["config"], " ".join([command, e["config"], *map(str, e.get("overrides") or [])])
