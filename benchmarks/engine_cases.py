"""The engine × estimator matrix's rows, one table for ``tests/test_engine_matrix.py`` (one test
per pair) and ``benchmarks/engines.py`` (the table in docs/engines.md).

Sizes: an MLP of depth ``M`` (one block per stage), ``N`` micro-batches of ``B`` examples,
``K`` tangents, ``M`` devices. A row is ``name -> Case(estimator, layout, refused)``: the
layout of the in-memory reference's batch (``"flat"`` (N·B, ...) or ``"micro"`` (N, B, ...)),
and the engines that refuse it, each with a pattern its refusal must match (the test checks
the refusal, the benchmark prints it). A name's suffix picks the model (:func:`models`): ``-own`` a local head per block,
``-grouped`` one per feature group, ``-aggregated`` Ren et al.'s feature aggregator.

Example::

    from engine_cases import ENGINES, cases, models
    for name, case in cases(exact_from=(2, 2, 5, 5)).items():
        ...
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

import jaxstream.grad as jg
from jaxstream.models import mlp, with_local_heads

M, N, B, K = 4, 4, 4, 2  # stages / devices, micro-batches, examples per micro-batch, tangents
SEL = (0, 1)  # the hybrids' exact micro-batches (static: a pipeline table fixes them)
IN_DIM, WIDTH, CLASSES = 6, 8, 3
ENGINES = ("dataparallel", "pipeline", "stream", "composed")


class Case(NamedTuple):
    """One row: the estimator, its reference batch's layout, ``engine -> pattern`` of the
    engines that refuse it and what their error must say."""

    estimator: Any
    layout: str
    refused: tuple[tuple[str, str], ...] = ()


def models() -> dict[str, Any]:
    """Suffix -> model: the plain MLP (``""``) and its local-loss designs."""
    plain = mlp(in_dim=IN_DIM, width=WIDTH, depth=M, num_classes=CLASSES)
    x = np.zeros((1, IN_DIM), np.float32)
    return {"": plain, "-own": with_local_heads(plain),
            "-grouped": with_local_heads(plain, groups=2, x=x),
            "-aggregated": with_local_heads(plain, groups=2, x=x, aggregate=True)}


def suffix(name: str) -> str:
    """The model suffix of row ``name`` (``""``: the plain MLP)."""
    return next((s for s in ("-own", "-grouped", "-aggregated") if name.endswith(s)), "")


def cases(exact_from: tuple[int, ...]) -> dict[str, Case]:
    """The rows. ``exact_from``: the nested hybrid's groups, as the ``truncated(M, N, SEL)``
    table produces them (the caller reads them off the table its own way)."""
    f, a = "flat", "micro"
    local_act = jg.forward(K, perturb="activations", local_losses=True)
    hyb = lambda correction: Case(jg.hybrid(exact_indices=SEL, correction=correction,
                                            num_tangents=K), a)
    return {
        "backprop": Case(jg.backprop(), f),
        "fwd-w-gauss": Case(jg.forward(K, "gaussian"), f),
        "fwd-w-rad": Case(jg.forward(K, "rademacher"), f),
        "fwd-w-orth": Case(jg.forward(K, "gaussian", orthogonal=True), f),
        "fwd-w-proj": Case(jg.forward(K, "gaussian", aggregation="projection"), f),
        "fwd-act": Case(jg.forward(K, perturb="activations"), f),
        "fwd-act-local": Case(local_act, f),
        "fwd-w-local": Case(jg.local_forward_weights(K, "gaussian"), f),  # LG-FG-W
        "fwd-act-own": Case(local_act, f),
        "fwd-w-local-own": Case(jg.local_forward_weights(K, "gaussian"), f),
        "fwd-act-grouped": Case(local_act, f),
        "fwd-act-aggregated": Case(local_act, f),
        # Fournier et al.: one guessed direction for the whole batch, which shared-tangent
        # data parallelism (a replica's rows of one draw) cannot carry
        "local-guess": Case(jg.local_guess(), f, (("dataparallel", "local_guess"),)),
        "local-guess-own": Case(jg.local_guess(), f, (("dataparallel", "local_guess"),)),
        "exact-subset": Case(jg.exact_subset(len(SEL)), a),
        "hyb-replace": hyb("replace"),
        "hyb-cv": hyb("control_variate"),
        "hyb-weighted": hyb("weighted"),
        "hyb-stein": hyb("stein"),
        "hyb-guess": hyb("guess"),
        "hyb-cv-nested": Case(jg.hybrid(exact_from=exact_from, correction="control_variate",
                                        num_tangents=K), a),
    }
