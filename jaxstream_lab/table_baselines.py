"""Baselines that put a forward-table row in its place: what a result is worth against chance,
a linear model, and (text) n-gram tables of the same training data.

* classification: ``chance`` (always the train set's most frequent class; loss log C of the
  uniform guess) and ``logistic regression`` (scikit-learn's L2 multinomial model on the same
  standardised features, fitted to convergence by L-BFGS; deterministic);
* next-character text: ``unigram`` and ``bigram`` tables of the train windows' characters,
  add-one smoothed over the vocabulary; loss is the test cross-entropy in nats per character,
  error the share of characters the table's most likely character misses.

Rows carry ``kind: "baseline"`` and one figure each (no seeds, no learning rate).

Example:
  >>> rows = baselines("digits", load_digits(), "error")
  >>> [r["arm"] for r in rows]
  ['chance', 'logistic regression']
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _row(dataset: str, arm: str, metric: str, test_err: float, train_err: float,
         test_loss: float, train_loss: float, how: str) -> dict:
    return {"dataset": dataset, "arm": arm, "kind": "baseline", "metric": metric,
            "test_error_mean": float(test_err), "train_error_mean": float(train_err),
            "test_loss_mean": float(test_loss), "train_loss_mean": float(train_loss),
            "how": how}


def _ngram(counts: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(cross-entropy in nats, error) of an add-one smoothed table ``counts`` (context, next)
    on contexts ``x`` and next characters ``y``."""
    p = (counts + 1.0) / (counts + 1.0).sum(axis=1, keepdims=True)
    return float(-np.mean(np.log(p[x, y]))), float(np.mean(np.argmax(p[x], axis=-1) != y))


def text_baselines(dataset: str, ds: Any, vocab: int) -> list[dict]:
    """Unigram and bigram tables of the train windows, scored on both splits."""
    tr_x, tr_y = np.asarray(ds.train["x"]).ravel(), np.asarray(ds.train["y"]).ravel()
    te_x, te_y = np.asarray(ds.test["x"]).ravel(), np.asarray(ds.test["y"]).ravel()
    uni = np.bincount(tr_y, minlength=vocab)[None].astype(np.float64)  # one context
    bi = np.zeros((vocab, vocab))
    np.add.at(bi, (tr_x, tr_y), 1.0)
    rows = []
    for name, counts, ctx in (("unigram", uni, lambda a: np.zeros_like(a)),
                              ("bigram", bi, lambda a: a)):
        te_loss, te_err = _ngram(counts, ctx(te_x), te_y)
        tr_loss, tr_err = _ngram(counts, ctx(tr_x), tr_y)
        rows.append(_row(dataset, name, "loss", te_err, tr_err, te_loss, tr_loss,
                         f"{name} table of the train characters, add-one smoothed"))
    return rows


def class_baselines(dataset: str, ds: Any, num_classes: int) -> list[dict]:
    """Chance (the train set's most frequent class) and logistic regression."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss

    x_tr = np.asarray(ds.train["x"], np.float64).reshape(len(ds.train["y"]), -1)
    x_te = np.asarray(ds.test["x"], np.float64).reshape(len(ds.test["y"]), -1)
    y_tr, y_te = np.asarray(ds.train["y"]), np.asarray(ds.test["y"])
    top = int(np.argmax(np.bincount(y_tr, minlength=num_classes)))
    labels = np.arange(num_classes)
    rows = [_row(dataset, "chance", "error", np.mean(y_te != top), np.mean(y_tr != top),
                 np.log(num_classes), np.log(num_classes),
                 "always the most frequent train class; loss of the uniform guess")]
    model = LogisticRegression(max_iter=5000).fit(x_tr, y_tr)
    rows.append(_row(dataset, "logistic regression", "error",
                     np.mean(model.predict(x_te) != y_te), np.mean(model.predict(x_tr) != y_tr),
                     log_loss(y_te, model.predict_proba(x_te), labels=labels),
                     log_loss(y_tr, model.predict_proba(x_tr), labels=labels),
                     "scikit-learn LogisticRegression (L2, C = 1, L-BFGS) on the same features"))
    return rows


def baselines(dataset: str, ds: Any, metric: str) -> list[dict]:
    """The baseline rows of one data set: n-gram tables for next-token data (``vocab_size`` in
    its info), else chance and logistic regression; ``metric`` ("error" or "loss") is how the
    table judges the data set, recorded in each row."""
    if "vocab_size" in ds.info:
        rows = text_baselines(dataset, ds, int(ds.info["vocab_size"]))
    else:
        rows = class_baselines(dataset, ds, int(ds.info["num_classes"]))
    return [{**r, "metric": metric} for r in rows]
