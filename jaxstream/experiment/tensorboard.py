"""TensorBoard event files beside ``metrics.jsonl``, written while the run trains (optional).

``jaxstream run CONFIG --tensorboard`` follows the run's ``metrics.jsonl`` as it grows
(:class:`LiveEvents`, a background thread polling every ``interval`` seconds, each new record's
scalars flushed at once), so the curves can be watched while the run trains and a crashed run
keeps them. :func:`write_events` writes a finished run directory's events in one go. One event
file per arm under ``RUN_DIR/tensorboard/<arm>/`` (``<arm>/lr=<lr>`` for an ``lr_sweep``):
every numeric field of every record as a scalar at its step (wall-clock fields included). It
uses ``tensorboardX`` (no TensorFlow; ``pip install tensorboardX``); view with
``tensorboard --logdir RUN_DIR/tensorboard``.

Example:
    >>> write_events("runs/quickstart")
    PosixPath('runs/quickstart/tensorboard')
"""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

SKIP = ("arm", "step", "lr")


def _writer_class() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ModuleNotFoundError as e:
        from jaxstream.experiment.config import ConfigError

        raise ConfigError("--tensorboard needs the tensorboardX package: pip install "
                          "tensorboardX (or pip install 'jaxstream[tensorboard]')") from e
    return SummaryWriter


class LiveEvents:
    """Follows ``RUN_DIR/metrics.jsonl`` and writes each complete new record as TensorBoard
    scalars. A log that was rewritten (a ``--resume`` drops the records after its checkpoint)
    is followed from its start again; TensorBoard shows the latest value written for a step."""

    def __init__(self, run_dir: str | Path, interval: float = 2.0):
        self.run_dir = Path(run_dir)
        self.out = self.run_dir / "tensorboard"
        self.interval = interval
        self._writer = _writer_class()
        self._writers: dict[str, Any] = {}
        self._offset, self._inode = 0, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> LiveEvents:
        """Poll in a daemon thread until :meth:`close`."""
        self._thread = threading.Thread(target=self._follow, name="tensorboard", daemon=True)
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> int:
        """Writes the records appended since the last poll; returns how many."""
        path = self.run_dir / "metrics.jsonl"
        with self._lock:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                return 0
            if st.st_ino != self._inode or st.st_size < self._offset:  # rewritten
                self._offset, self._inode = 0, st.st_ino
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # complete lines only: a record being written waits
            self._offset += end
            count = 0
            for line in data[:end].splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a damaged line (MetricsLog.read warns about it)
                    continue
                count += self._write(record)
            for w in self._writers.values():
                w.flush()
            return count

    def _write(self, r: dict) -> int:
        if not isinstance(r, dict):
            return 0
        arm = str(r.get("arm", "run"))
        if r.get("lr") is not None:  # lr_sweep: one series per learning rate
            arm = f"{arm}/lr={r['lr']:g}"
        w = self._writers.get(arm) or self._writers.setdefault(
            arm, self._writer(str(self.out / arm)))
        for key, value in r.items():
            if key in SKIP or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                w.add_scalar(key, float(value), global_step=int(r.get("step", 0)))
        return 1

    def close(self) -> Path:
        """Stops following, writes what is left, closes the files; returns the events dir."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll()
        for w in self._writers.values():
            w.close()
        return self.out


def write_events(run_dir: str | Path) -> Path:
    """Write the scalars of ``RUN_DIR/metrics.jsonl`` as TensorBoard events; returns the dir."""
    return LiveEvents(run_dir).close()
