"""Kills one of the two processes of a composed run and reports what the survivor and the two
store copies did (``tests/compose/kill_worker.py`` is the run).

``python -m tests.compose.kills [KILLS] [SEED]`` runs KILLS (default 10) kills at varied points
(named points inside the second step, and timed kills of either process) and prints one line
per kill and the counts: survivors that stopped with exit status 2 and one line within the
wait allowed, copies that agree, restarts that refused naming both copies or repaired them.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.processes import free_port

WORKER = Path(__file__).with_name("kill_worker.py")
POINTS = ("before_commit", "after_commit", "mid_sweep")
#: How long a survivor may take to end after its peer died: the run's peer_timeout_s (5 s)
#: plus the time to notice, write its line and exit on a loaded machine.
ALLOWED_S = 45.0


@dataclass
class Kill:
    """What one kill left behind."""

    point: str
    victim: int
    survivor_rc: int | None
    ended_s: float | None  # from the victim's death to the survivor's exit
    lines: list[str]  # the survivor's stderr lines from jaxstream
    aborted: bool  # a C++ check failure, abort or Python traceback on the survivor's stderr
    steps: tuple[int, int]  # the two copies' committed steps after the kill
    opened: tuple[str, str]  # what each process said on the restart
    restart_lines: list[str]  # the restart's stderr lines from jaxstream (a rollback's)
    tails: tuple[str, str] = ("", "")  # each process's last stderr, for a failing test's message

    @property
    def clean_stop(self) -> bool:
        return (self.survivor_rc == 2 and len(self.lines) == 1 and not self.aborted
                and self.ended_s is not None and self.ended_s < ALLOWED_S)

    @property
    def agree(self) -> bool:
        return self.steps[0] == self.steps[1]

    @property
    def restart(self) -> str:
        """``agreed`` (same step, unchanged), ``repaired`` (one copy rolled back, then agreed),
        ``refused`` (both processes named both copies) or ``failed``."""
        if all(o.startswith("agreed") for o in self.opened):
            return "agreed" if self.agree else "repaired"
        if all("process 0 at step" in o and "process 1 at step" in o for o in self.opened):
            return "refused"
        return "failed"

    def line(self) -> str:
        return (f"{self.point:>14} kill p{self.victim}: survivor rc={self.survivor_rc} after "
                f"{'-' if self.ended_s is None else f'{self.ended_s:.1f}'} s, "
                f"{len(self.lines)} jaxstream line(s), abort={self.aborted}; copies at "
                f"{self.steps}; restart {self.restart}")


def _spawn(port: str, pid: int, root: Path, mode: str, point: str = "",
           env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKER), port, str(pid), str(root), mode, point],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _step_of(root: Path, pid: int) -> tuple[int, float] | None:
    f = root / f"step{pid}.txt"
    try:
        s, t = f.read_text().split()
        return int(s), float(t)
    except (OSError, ValueError):
        return None


def _store_step(where: Path) -> int:
    """The copy's committed step (-1: no copy written)."""
    import json

    try:
        return int(json.loads((where / "manifest.json").read_text())["step"])
    except OSError:
        return -1


def kill_once(root: Path, point: str, victim: int = 1, delay: float = 0.0,
              env: dict | None = None, timeout: float = 400,
              restart: bool | None = True) -> Kill:
    """One run of both processes, one of them killed: at a named ``point`` of process 1's second
    step, or (``point="timed"``) ``delay`` s after both committed their first step. Then both
    restart on their copies (``restart=None``: only when the copies' steps differ)."""
    port = str(free_port())
    env = {**os.environ, **(env or {})}
    named = point in POINTS
    procs = [_spawn(port, i, root, "train", point if named else "", env) for i in range(2)]
    died = None
    try:
        if not named:
            t0 = time.monotonic()
            while not all(_step_of(root, i) for i in range(2)):
                if any(p.poll() is not None for p in procs) or time.monotonic() - t0 > timeout:
                    break
                time.sleep(0.05)
            time.sleep(delay)
            procs[victim].send_signal(signal.SIGKILL)
            died = time.time()
        outs = [None, None]
        outs[victim] = procs[victim].communicate(timeout=timeout)
        survivor = procs[1 - victim]
        outs[1 - victim] = survivor.communicate(timeout=timeout)
        ended = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if named:  # the victim died when it stopped; its exit is seen at once (no clean-up)
        died = _death_time(root, victim, procs[victim])
    err = outs[1 - victim][1]
    lines = [ln for ln in err.splitlines() if ln.startswith("jaxstream:")]
    aborted = bool(re.search(r"Check failure|Traceback|^F\d{4} |Aborted|Terminating process",
                             err, re.MULTILINE)) or survivor.returncode in (-6, 134)
    steps = (_store_step(root / "store0"), _store_step(root / "store1"))
    if restart or (restart is None and steps[0] != steps[1]):
        opened, restart_lines = _restart(root, env, timeout)
    else:  # both at one step: what opening would check, read from the manifests
        fp = {_fingerprint(root / f"store{i}") for i in range(2)}
        opened = (f"agreed {steps[0]}",) * 2 if len(fp) == 1 else ("differ", "differ")
        restart_lines = []
    return Kill(point if named else f"timed+{delay:.2f}s", victim, survivor.returncode,
                None if died is None else ended - died, lines, aborted, steps, opened,
                restart_lines, (outs[0][1][-1500:], outs[1][1][-1500:]))


def _fingerprint(where: Path) -> int:
    """The copy's commit fingerprint, as :meth:`LayerStore.fingerprint` computes it."""
    from jaxstream.stream import LayerStore

    return LayerStore.open(where).fingerprint()


def _death_time(root: Path, victim: int, proc: subprocess.Popen) -> float | None:
    """When a self-killed victim died (it writes the time just before it exits)."""
    f = root / f"died{victim}.txt"
    return float(f.read_text()) if f.exists() else None


def _restart(root: Path, env: dict, timeout: float) -> tuple[tuple[str, str], list[str]]:
    """Both processes open their copies again: what each said, and jaxstream's stderr lines."""
    port = str(free_port())
    procs = [_spawn(port, i, root, "open", "", env) for i in range(2)]
    lines = []
    try:
        for p in procs:
            err = p.communicate(timeout=timeout)[1]
            lines += [ln for ln in err.splitlines() if ln.startswith("jaxstream:")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    said = []
    for i in range(2):
        f = root / f"open{i}.txt"
        said.append(f.read_text() if f.exists() else f"no answer (exit {procs[i].returncode})")
    return (said[0], said[1]), lines


def main(kills: int = 10, seed: int = 0) -> list[Kill]:
    """``kills`` kills: the named points in turn, then timed kills of process 1 or 0."""
    rnd = random.Random(seed)
    plan = []
    for k in range(kills):
        if k < len(POINTS):
            plan.append((POINTS[k], 1, 0.0))
        else:
            plan.append(("timed", k % 2, rnd.uniform(0.0, 4.0)))
    done = []
    for point, victim, delay in plan:
        with tempfile.TemporaryDirectory() as d:
            k = kill_once(Path(d), point, victim, delay)
        print(k.line(), flush=True)
        if not k.clean_stop:  # what the survivor wrote last
            for ln in k.tails[1 - k.victim].strip().splitlines()[-3:]:
                print(f"{'':>16}| {ln[:160]}", flush=True)
        done.append(k)
    n = len(done)
    print(f"survivor stopped with exit 2 and one line within {ALLOWED_S:g} s: "
          f"{sum(k.clean_stop for k in done)}/{n}; copies agree: {sum(k.agree for k in done)}/{n}; "
          f"restart: agreed {sum(k.restart == 'agreed' for k in done)}, repaired "
          f"{sum(k.restart == 'repaired' for k in done)}, refused naming both "
          f"{sum(k.restart == 'refused' for k in done)}, failed "
          f"{sum(k.restart == 'failed' for k in done)}")
    return done


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
