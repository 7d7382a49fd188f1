"""A forward table's data: each data set as the arms train on it, with its validation split
(:func:`table_data`), and the one evaluator of a data set's lanes
(:func:`lanes_evaluator`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream_lab.table_config import TableDataset


class TableData(NamedTuple):
    """A data set as the table trains on it: ``train`` (without the validation rows), ``test``,
    ``info``, and ``validation`` (the held-out training rows, or None)."""

    train: dict
    test: dict
    info: dict
    validation: dict | None = None


def table_data(dcfg: TableDataset, seed: int) -> TableData:
    """The data set of ``dcfg`` loaded with ``seed``, a ``dcfg.validation`` share of its
    training set held out (rows of a permutation keyed by ``seed``; at least one each side)."""
    ds = dcfg.data.dataset(seed)
    if dcfg.validation is None:
        return TableData(ds.train, ds.test, ds.info)
    n = len(next(iter(ds.train.values())))
    held = min(n - 1, max(1, round(dcfg.validation * n)))
    order = np.random.default_rng(seed).permutation(n)
    part = lambda idx: {k: np.asarray(v)[np.sort(idx)] for k, v in ds.train.items()}
    return TableData(part(order[held:]), ds.test, ds.info, part(order[:held]))


def lanes_evaluator(stack: Any, ds: TableData, train_eval_size: int):
    """One jitted ``params (lanes) -> (lanes, M)``: test error, train error, test loss, train
    loss, and with a validation split validation error and loss (M = 6; else 4); shared by the
    arms of a data set (one compile per lane count)."""
    test = {k: jnp.asarray(v) for k, v in ds.test.items()}
    sub = {k: jnp.asarray(v[:train_eval_size]) for k, v in ds.train.items()}
    val = None if ds.validation is None else {k: jnp.asarray(v) for k, v in ds.validation.items()}

    def metrics(params):
        err = lambda b: jnp.clip(1.0 - stack.accuracy(params, b), 0.0, 1.0)
        out = [err(test), err(sub), stack(params, test), stack(params, sub)]
        if val is not None:
            out += [err(val), stack(params, val)]
        return jnp.stack(out)

    return jax.jit(jax.vmap(metrics))
