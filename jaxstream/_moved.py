"""Old import paths kept working for one release: each warns once where it is imported and
hands back the module that now holds the code."""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType


def moved(old: str, new: str) -> ModuleType:
    """``new``'s module, after a ``DeprecationWarning`` at the user's ``import old`` line."""
    warnings.warn(f"{old} moved to {new}: import it from there ({old} is an alias that will be "
                  f"removed in a later release)", DeprecationWarning, stacklevel=_caller_level())
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def _caller_level() -> int:
    """``stacklevel`` of the first frame outside this module, the alias and the import system
    (``warnings`` itself skips the frozen import frames, so they are not counted)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                 or frame.f_globals.get("__name__", "").startswith("importlib")
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_globals.get("__name__", "") in _ALIASES):
        level += not frame.f_code.co_filename.startswith("<frozen")
        frame = frame.f_back
    return level


_ALIASES = {
    "jaxstream.plugins": "jaxstream.experiment.plugins",
    "jaxstream.data.configs": "jaxstream.experiment.data_configs",
    "jaxstream.comm.engine": "jaxstream.experiment.engine_dataparallel",
    "jaxstream.pipeline.engine": "jaxstream.experiment.engine_pipeline",
    "jaxstream.stream.engine": "jaxstream.experiment.engine_stream",
    "jaxstream.stream.plan_cli": "jaxstream.experiment.plan_cli",
    "jaxstream.quality.study": "jaxstream.experiment.quality_study",
    "jaxstream.optim.plugin": "jaxstream.experiment.optimizers",
}
