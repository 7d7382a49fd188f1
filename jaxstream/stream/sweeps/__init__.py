"""The streamed executor's sweep algorithms, one per file (DESIGN §9).

Each sweep takes the driver (the :class:`~jaxstream.stream.StreamedExecutor`: its reads and
prefetch, its host-update queue and writes, the placement and the plan) and runs one
estimator's sweeps over the step's layers, handing each unit's gradient to ``sink``. The
executor keeps I/O, prefetch, the update queue and the commit.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxstream.grad.plan import Plan


def sweeps_of(plan: Plan) -> Callable:
    """The sweeps that run ``plan``: ``run(ex, batch, key, layers, sink, t0, commit_lazy)
    -> (loss, new pending records)``."""
    from jaxstream.stream.sweeps.activity import run_activity
    from jaxstream.stream.sweeps.forward import run_forward
    from jaxstream.stream.sweeps.local_guess import run_local_guess
    from jaxstream.stream.sweeps.reverse import run_reverse

    fp = plan.forward_pass
    if fp.scalars and plan.exact == "none":
        return run_forward
    if plan.local:
        return lambda ex, b, k, ls, sink, t0, _: (run_activity(ex, b, k, ls, sink, t0), {})
    if fp.guess:
        return lambda ex, b, k, ls, sink, t0, _: (run_local_guess(ex, b, ls, sink, t0), {})
    return run_reverse

