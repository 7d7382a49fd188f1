"""TensorBoard event files beside ``metrics.jsonl`` (optional, off by default).

``jaxstream run CONFIG --tensorboard`` (or :func:`write_events` on any run directory) writes one
event file per arm under ``RUN_DIR/tensorboard/<arm>/``: every numeric field of every record
as a scalar at its step (wall-clock fields included). It uses ``tensorboardX`` (no TensorFlow;
``pip install tensorboardX``); view with ``tensorboard --logdir RUN_DIR/tensorboard``.

Example:
    >>> write_events("runs/quickstart")
    PosixPath('runs/quickstart/tensorboard')
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxstream.experiment.rundir import MetricsLog

SKIP = ("arm", "step")


def write_events(run_dir: str | Path) -> Path:
    """Write the scalars of ``RUN_DIR/metrics.jsonl`` as TensorBoard events; returns the dir."""
    try:
        from tensorboardX import SummaryWriter
    except ModuleNotFoundError as e:
        from jaxstream.experiment.config import ConfigError

        raise ConfigError("--tensorboard needs the tensorboardX package: pip install "
                          "tensorboardX (or pip install 'jaxstream[tensorboard]')") from e
    run_dir = Path(run_dir)
    out = run_dir / "tensorboard"
    records = MetricsLog(run_dir / "metrics.jsonl").read()
    writers: dict[str, SummaryWriter] = {}
    for r in records:
        arm = str(r.get("arm", "run"))
        if r.get("lr") is not None and "lr" not in SKIP:  # lr_sweep: one series per lr
            arm = f"{arm}/lr={r['lr']:g}"
        w = writers.get(arm) or writers.setdefault(arm, SummaryWriter(str(out / arm)))
        for key, value in r.items():
            if key in SKIP or key == "lr" or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                w.add_scalar(key, float(value), global_step=int(r.get("step", 0)))
    for w in writers.values():
        w.close()
    return out
