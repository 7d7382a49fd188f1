"""Tables in docs/ are written by a command, never by hand: one marker, one writer, one machine.

A doc marks each table that a command writes::

    <!-- generated: KEY -->
    ... (replaced) ...
    <!-- end generated -->

``KEY`` is either a run-table command of ``jaxstream.experiment.doctable`` (``compare
runs/quickstart``, ``sweep RUN``, ``ticks RUN``) or a benchmark's ``SCRIPT NAME``
(``dataparallel.py allreduce``). Each writer renders the keys it owns and leaves the others
byte for byte; a table ends with a line naming the command and the machine (`machine`).

Example:
    >>> write_tables("docs/dataparallel.md", "dataparallel.py", {"allreduce": "| a |"}, cmd)
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

BLOCK = re.compile(r"(<!-- generated: (?P<key>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)",
                   re.DOTALL)


def machine(env: dict[str, Any] | None = None) -> str:
    """One phrase for a machine: OS, CPU cores, JAX version, backend and devices.

    ``env``: a run's ``env.json`` (`rundir.environment`); None describes this machine.
    """
    if env is None:
        from jaxstream.experiment.rundir import environment

        env = environment()
    cpus = f", {env['cpus']} CPU cores" if env.get("cpus") else ""
    jax_version = env.get("versions", {}).get("jax", "?")
    return (f"{env.get('platform', '?')}{cpus}, JAX {jax_version} on {env.get('backend', '?')} "
            f"({env.get('device_count', '?')} x {env.get('device', '?')})")


def portable(command: str) -> str:
    """``command`` with each absolute path cut to its file name: a doc names no place outside
    the repository (``--json /tmp/ns.json`` is written ``--json ns.json``)."""
    return " ".join(Path(w).name if w.startswith("/") else w for w in command.split(" "))


def footer(command: str, where: str | None = None) -> str:
    """The line under a written table: the command, the machine and, for a table measured now,
    the day (``where`` names the machine of an earlier run, whose day is not known here).
    Absolute paths in ``command`` are cut to their file names (`portable`)."""
    command = portable(command)
    if where is not None:
        return f"Written by `{command}` on {where}."
    return f"Written by `{command}` on {machine()}, {datetime.date.today().isoformat()}."


def rewrite(doc: str | Path, render: Callable[[str], str | None]) -> list[str]:
    """Replace each marked block whose ``render(key)`` is a string; returns the keys written.

    Blocks whose render is None stay as they are. Every block is rendered before the file is
    written, so a render that raises leaves the doc unchanged.
    """
    path = Path(doc)
    written: list[str] = []

    def sub(m: re.Match) -> str:
        body = render(m.group("key"))
        if body is None:
            return m.group(0)
        written.append(m.group("key"))
        return f"{m.group(1)}{body.rstrip()}\n{m.group(4)}"

    text = BLOCK.sub(sub, path.read_text())
    path.write_text(text)
    return written


def write_tables(doc: str | Path, script: str, tables: dict[str, str], command: str,
                 keep: tuple[str, ...] = (), where: str | None = None) -> list[str]:
    """Write a benchmark's tables into the ``SCRIPT NAME`` blocks of ``doc``; returns the names.

    ``keep``: blocks this run may leave as they are (a partial run that did not measure them
    keeps the last full run's table and its footer). ``where``: the machine the tables were
    measured on, when not this one (tables written from an earlier run's JSON).

    Raises:
      ValueError: a block of ``script`` names a table the run did not produce (and not in
        ``keep``); the doc is left unchanged.
    """
    end = footer(command, where)

    def render(key: str) -> str | None:
        words = key.split()
        if len(words) != 2 or words[0] != script:
            return None
        name = words[1]
        if name in tables:
            return f"{tables[name].rstrip()}\n\n{end}"
        if name in keep:
            return None
        raise ValueError(f"{doc}: block {name!r} of {script} is not a table of this run; "
                         f"tables: {sorted(tables)}")

    return [key.split()[1] for key in rewrite(doc, render)]
