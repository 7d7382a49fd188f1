"""Orbax checkpoints of one arm's engine state, with the step and a little JSON metadata.

Saving is synchronous: a checkpoint that exists is complete (orbax writes to a temporary
directory and renames it), so a run killed mid-save still resumes from the previous one.

Example:
    >>> ckpt = ArmCheckpointer(run_dir / "checkpoints" / "backprop")
    >>> ckpt.save(100, state, {"train_time": 1.2})
    >>> step, state, meta = ckpt.restore_latest(state)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


class ArmCheckpointer:
    """A small wrapper around ``orbax.checkpoint.CheckpointManager`` (host-side state)."""

    def __init__(self, directory: str | Path, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False,
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """The last saved step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> None:
        """Save ``state`` (a pytree of arrays) and JSON ``meta`` as ``step``."""
        meta = dict(meta or {}, step=int(step))
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, like: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` into the structure, shapes and dtypes of ``like``."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                    meta=ocp.args.JsonRestore()),
        )
        return jax.tree.map(_placed_like, out["state"], like), dict(out["meta"])

    def restore_latest(self, like: Any) -> tuple[int | None, Any, dict[str, Any]]:
        """``(step, state, meta)`` of the latest checkpoint, or ``(None, like, {})``."""
        step = self.latest_step()
        if step is None:
            return None, like, {}
        state, meta = self.restore(step, like)
        return step, state, meta

    def close(self) -> None:
        self.manager.close()


def _placed_like(restored: Any, like: Any) -> Any:
    """``restored`` placed as ``like`` was. Orbax returns arrays committed to a device; where the
    state was uncommitted (a fresh run's), a committed copy is a different input sharding to the
    jitted step, which would then recompile instead of reusing the compiled step."""
    if (isinstance(like, jax.Array) and not like.committed and isinstance(restored, jax.Array)
            and not jnp.issubdtype(restored.dtype, jax.dtypes.prng_key)):
        return jnp.asarray(np.asarray(restored))
    return restored
