"""Rewrite a doc's benchmark tables from a benchmark's own output, never by hand.

A doc marks each table a benchmark writes::

    <!-- benchmark: dataparallel.py allreduce -->
    ... (replaced) ...
    <!-- end benchmark -->

``write_blocks(doc, "dataparallel.py", tables, command)`` replaces every block of that script
whose name is in ``tables`` by the table and a line naming the command and the machine.

Example:
    >>> write_blocks("docs/dataparallel.md", "dataparallel.py", {"allreduce": "| a |"}, cmd)
"""

from __future__ import annotations

import datetime
import os
import platform
import re
from pathlib import Path

import jax

BLOCK = re.compile(
    r"(<!-- benchmark: (?P<script>\S+) (?P<name>\S+) -->\n)(?P<body>.*?)(<!-- end benchmark -->)",
    re.DOTALL,
)


def machine() -> str:
    """One phrase for this machine: OS, CPU count, JAX version, backend and devices."""
    devices = jax.devices()
    return (
        f"{platform.platform()}, {os.cpu_count()} CPU cores, JAX {jax.__version__} on "
        f"{jax.default_backend()} ({len(devices)} x {devices[0].device_kind})"
    )


def write_blocks(doc: str | Path, script: str, tables: dict[str, str], command: str,
                 keep: tuple[str, ...] = ()) -> list[str]:
    """Replace the marked blocks of ``script`` in ``doc``; returns the names written.

    ``keep``: blocks this run may leave as they are (a partial run that did not measure
    them keeps the last full run's table and its footer).

    Raises:
      ValueError: a block of ``script`` names a table the run did not produce (and not in
        ``keep``).
    """
    path = Path(doc)
    text = path.read_text()
    day = datetime.date.today().isoformat()
    footer = f"Written by `{command}` on {machine()}, {day}."
    written: list[str] = []

    def sub(m: re.Match) -> str:
        if m.group("script") != script:
            return m.group(0)
        name = m.group("name")
        if name not in tables:
            if name in keep:
                return m.group(0)
            raise ValueError(
                f"{path}: block {name!r} of {script} is not a table of this run; "
                f"tables: {sorted(tables)}"
            )
        written.append(name)
        return f"{m.group(1)}{tables[name]}\n\n{footer}\n{m.group(5)}"

    new = BLOCK.sub(sub, text)
    path.write_text(new)
    return written
