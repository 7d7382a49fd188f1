"""jaxstream: forward-mode (jvp) gradient estimators, pipelines whose bubbles run reverse mode,
and training with layers streamed from TensorStore."""

__version__ = "0.1.0"
