"""The library's own experiment kinds and engines: importing this module registers them.

The experiment layer imports the engines (never the other way round): each module below wraps a
library package (``jaxstream.pipeline``, ``jaxstream.stream``, ``jaxstream.comm``,
``jaxstream.quality``) as an ``engine: {type: ...}`` or a ``kind: ...``. The lab's kind
(``forward_table``, :mod:`jaxstream_lab`) registers itself as a plugin: nothing here imports it.
"""

from jaxstream.experiment import (  # noqa: F401
    engine_composed,
    engine_dataparallel,
    engine_pipeline,
    engine_stream,
    finetune,
    lr_sweep,
    quality_study,
    train,
)
