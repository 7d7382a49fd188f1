"""Verdicts on paired by-seed differences: the mean with its 95 % interval, Student's paired
t-test, an equivalence test (two one-sided tests, TOST) against a stated margin, Holm's
adjustment over a family of comparisons, and the word a comparison earns.

Pure functions of lists of numbers (SciPy for the t distribution), so the forward table's
report (:mod:`jaxstream_lab.table_report`) and its tests share one definition of
"better", "worse", "≈" and "inconclusive":

- "better" / "worse": ``a − b`` below / above zero, two-sided paired t-test significant at
  :data:`ALPHA` after Holm's adjustment over the family;
- "≈": ``|a − b|`` below the margin by TOST (the larger one-sided p under :data:`ALPHA` after
  Holm), and only with at least :data:`MIN_SEEDS_EQUIVALENT` paired seeds: with fewer, the t
  quantile is so wide that "no difference" says nothing;
- "inconclusive": neither (or fewer than :data:`MIN_SEEDS_TEST` paired seeds, or every seed
  differing by the same amount: no spread, so t is undefined).

"≈" is checked before "better"/"worse": a difference that is real but inside the margin is,
by the margin's definition, too small to matter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

ALPHA = 0.05  # level of every test (two-sided for differences, each side for TOST)
LEVEL = 0.95  # coverage of the printed intervals
MIN_SEEDS_TEST = 3  # paired seeds any test needs
MIN_SEEDS_EQUIVALENT = 5  # paired seeds an "≈" needs
WORDS = ("better", "worse", "≈", "inconclusive")


def paired_difference(a: Sequence[float], b: Sequence[float], margin: float,
                      level: float = LEVEL) -> dict:
    """Seed i of ``a`` against seed i of ``b`` (the first ``n = min(len)`` of each):
    ``{"n", "mean", "sd", "lo", "hi", "t", "df", "p", "p_tost", "margin"}`` with ``lo, hi`` the
    ``level`` interval of the mean difference (Student's t, df = n − 1), ``p`` the two-sided
    paired t-test (``scipy.stats.ttest_rel``) and ``p_tost`` the larger of the one-sided
    p-values of ``mean > −margin`` and ``mean < +margin``. Only ``{"n"}`` below
    :data:`MIN_SEEDS_TEST` seeds; ``{"n", "mean", "constant": True}`` where every seed differs
    by the same nonzero amount (t undefined). Identical arms: t = 0, p = 1."""
    if margin <= 0:
        raise ValueError(f"margin: {margin} must be > 0 (the smallest difference that matters)")
    n = min(len(a), len(b))
    if n < MIN_SEEDS_TEST:
        return {"n": n}
    from scipy import stats

    d = [float(x) - float(y) for x, y in zip(a[:n], b[:n])]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    tiny = 1e-12 * max([abs(float(x)) for x in [*a[:n], *b[:n]]] + [1e-300])  # rounding
    if sd <= tiny and abs(mean) > tiny:
        return {"n": n, "mean": mean, "constant": True}
    df = n - 1
    if sd <= tiny:  # identical arms: ttest_rel gives nan
        mean = sd = 0.0
    se = sd / math.sqrt(n)
    if sd == 0.0:
        t, p = 0.0, 1.0
    else:
        res = stats.ttest_rel(list(a[:n]), list(b[:n]))
        t, p = float(res.statistic), float(res.pvalue)
    half = float(stats.t.ppf(0.5 + level / 2, df)) * se
    if se == 0.0:  # zero difference and no spread: inside any margin
        p_tost = 0.0
    else:
        p_above = float(stats.t.sf((mean + margin) / se, df))  # H0: mean <= -margin
        p_below = float(stats.t.cdf((mean - margin) / se, df))  # H0: mean >= +margin
        p_tost = max(p_above, p_below)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half, "t": t,
            "df": df, "p": p, "p_tost": p_tost, "margin": margin}


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment, in the input's order: the i-th smallest p (from 0) times
    ``m − i``, made non-decreasing along the sorted order, capped at 1. Rejecting where the
    adjusted p is below alpha keeps the family-wise error rate at alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def verdict(test: dict, p_holm: float | None = None, p_tost_holm: float | None = None,
            alpha: float = ALPHA) -> str:
    """The word of one comparison ``a − b`` (lower is better: errors, losses) from
    :func:`paired_difference` and its Holm-adjusted p-values (default: unadjusted)."""
    if "p" not in test:
        return "inconclusive"
    p = test["p"] if p_holm is None else p_holm
    p_tost = test["p_tost"] if p_tost_holm is None else p_tost_holm
    if test["n"] >= MIN_SEEDS_EQUIVALENT and p_tost < alpha:
        return "≈"
    if p < alpha:
        return "better" if test["mean"] < 0 else "worse"
    return "inconclusive"


def family(tests: Sequence[dict], alpha: float = ALPHA) -> list[dict]:
    """Each test of one family with ``p_holm``, ``p_tost_holm`` (Holm over the tests that
    were made), ``m`` (that number) and its ``verdict``; tests not made stay as they are,
    with verdict "inconclusive"."""
    made = [i for i, t in enumerate(tests) if "p" in t]
    p_holm = holm([tests[i]["p"] for i in made])
    p_tost_holm = holm([tests[i]["p_tost"] for i in made])
    out = [{**t, "verdict": "inconclusive"} for t in tests]
    for i, ph, pt in zip(made, p_holm, p_tost_holm):
        out[i].update(p_holm=ph, p_tost_holm=pt, m=len(made))
        out[i]["verdict"] = verdict(tests[i], ph, pt, alpha)
    return out
