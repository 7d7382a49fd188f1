"""The streamed executor's sweep algorithms, one per file (DESIGN §9).

Each sweep takes the driver (the :class:`~jaxstream.stream.StreamedExecutor`: its reads and
prefetch, its host-update queue and writes, the placement and the plan) and runs one
estimator's sweeps over the step's layers, handing each unit's gradient to ``sink``. The
executor keeps I/O, prefetch, the update queue and the commit.
"""
