"""Verdicts on paired differences against SciPy's tests and hand-worked examples: the 95 %
interval, the paired t-test, TOST against a margin, Holm's adjustment and the words."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from jaxstream_lab.verdicts import family, holm, paired_difference, verdict


def test_interval_and_t_match_a_hand_worked_example():
    """Differences 1, 2, 3: mean 2, sd 1, se 1/sqrt(3); t_{0.975, 2} = 4.302653 (tables)."""
    got = paired_difference([2.0, 4.0, 6.0], [1.0, 2.0, 3.0], margin=0.5)
    assert got["n"] == 3 and got["df"] == 2 and got["mean"] == pytest.approx(2.0)
    half = 4.302653 / math.sqrt(3)
    assert got["lo"] == pytest.approx(2.0 - half, rel=1e-6)
    assert got["hi"] == pytest.approx(2.0 + half, rel=1e-6)
    assert got["t"] == pytest.approx(2.0 * math.sqrt(3))


def test_t_test_and_tost_match_scipy():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.30, 0.02, 6), rng.normal(0.29, 0.02, 6)
    got = paired_difference(a, b, margin=0.03)
    ref = stats.ttest_rel(a, b)
    np.testing.assert_allclose([got["t"], got["p"]], [ref.statistic, ref.pvalue], rtol=1e-10)
    d = a - b
    lower = stats.ttest_1samp(d, -0.03, alternative="greater").pvalue
    upper = stats.ttest_1samp(d, 0.03, alternative="less").pvalue
    assert got["p_tost"] == pytest.approx(max(lower, upper), rel=1e-10)
    lo, hi = stats.t.interval(0.95, 5, loc=d.mean(), scale=stats.sem(d))
    np.testing.assert_allclose([got["lo"], got["hi"]], [lo, hi], rtol=1e-10)


def test_tost_rejects_exactly_when_the_90_percent_interval_sits_inside_the_margin():
    rng = np.random.default_rng(1)
    for _ in range(50):
        d = rng.normal(rng.uniform(-0.02, 0.02), 0.01, 5)
        got = paired_difference(d, np.zeros(5), margin=0.015)
        lo, hi = stats.t.interval(0.90, 4, loc=d.mean(), scale=stats.sem(d))
        assert (got["p_tost"] < 0.05) == (-0.015 < lo and hi < 0.015)


def test_the_interval_covers_the_true_difference_at_its_level():
    """2000 draws of 5 paired seeds: coverage within 4 binomial sd of 0.95."""
    rng = np.random.default_rng(2)
    n = 2000
    hits = 0
    for _ in range(n):
        a = rng.normal(0.0, 1.0, 5)
        b = a - 0.3 + rng.normal(0.0, 0.5, 5)  # true a - b: +0.3
        got = paired_difference(a, b, margin=0.1)
        hits += got["lo"] <= 0.3 <= got["hi"]
    assert abs(hits / n - 0.95) < 4 * math.sqrt(0.95 * 0.05 / n)


def test_holm_matches_a_hand_worked_example():
    """Sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> made
    non-decreasing: 0.02, 0.03, 0.06, 0.06; back in the input's order."""
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([]) == []


def test_words_need_five_seeds_for_equivalence_and_holm_for_differences():
    base = [0.100, 0.120, 0.110, 0.105, 0.115]
    close = [x + 0.001 * s for x, s in zip(base, (1, -1, 1, 0, -1))]
    five = paired_difference(close, base, margin=0.005)
    assert verdict(five) == "≈"
    three = paired_difference(close[:3], base[:3], margin=0.005)
    assert three["p_tost"] < 0.05 and verdict(three) == "inconclusive"  # 3 seeds: no "≈"
    worse = paired_difference([x + 0.05 + 0.002 * i for i, x in enumerate(base)], base, 0.005)
    assert verdict(worse) == "worse" and verdict(worse, p_holm=0.06) == "inconclusive"
    better = paired_difference(base, [x + 0.05 + 0.002 * i for i, x in enumerate(base)], 0.005)
    assert verdict(better) == "better"
    assert verdict(paired_difference([1.0, 2.0], [1.0, 2.0], 0.1)) == "inconclusive"  # n = 2
    shifted = paired_difference([x + 0.01 for x in base], base, 0.005)
    assert shifted.get("constant") and verdict(shifted) == "inconclusive"
    same = paired_difference(base, base, 0.005)
    assert same["p"] == 1.0 and same["t"] == 0.0 and verdict(same) == "≈"
    with pytest.raises(ValueError, match="margin"):
        paired_difference(base, base, 0.0)


def test_a_family_is_adjusted_over_the_tests_it_made():
    rng = np.random.default_rng(3)
    base = rng.normal(0.2, 0.01, 5)
    tests = [paired_difference(base + d + rng.normal(0, 0.01, 5), base, 0.005)
             for d in (0.03, 0.0, 0.01)]
    tests.append(paired_difference([0.1, 0.2], [0.1, 0.3], 0.005))  # too few seeds: not made
    got = family(tests)
    ps = [t["p"] for t in tests[:3]]
    assert [g["p_holm"] for g in got[:3]] == pytest.approx(holm(ps))
    assert [g["m"] for g in got[:3]] == [3, 3, 3] and "m" not in got[3]
    assert got[3]["verdict"] == "inconclusive"
    for g in got[:3]:
        assert g["verdict"] == verdict(g, g["p_holm"], g["p_tost_holm"])
