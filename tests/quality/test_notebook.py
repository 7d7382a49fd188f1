"""The forward-vs-backprop notebook: committed with its outputs, runs top to bottom, and every
result its text states holds for the numbers it prints."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from scipy import stats

from jaxstream.quality import gaussian_cosine_approx, gaussian_cosine_std
from tests import notebook_claims as nbc

NOTEBOOK = nbc.ROOT / "notebooks" / "01_forward_vs_backprop.ipynb"
K1, K16 = "forward K=1 gaussian", "forward K=16"
CV, WEIGHTED = "hybrid control variate", "hybrid weighted"


def chi_mean(k: int) -> float:
    """E[chi_k], the mean length of a standard normal vector in k dimensions."""
    return math.sqrt(2) * math.exp(math.lgamma((k + 1) / 2) - math.lgamma(k / 2))


def check_claims(c: dict[str, Any]) -> None:
    """Each result the notebook's text states, against its numbers."""
    n, s, w = c["n"], c["seeds"], c["whole"]

    def se(*names: str) -> float:  # standard error of a mean (of a difference) over s keys
        return math.sqrt(sum(w[e]["cosine_std"] ** 2 for e in names) / s)

    # Backprop is 1 by construction (float32 sums over n parameters).
    assert w["backprop"]["cosine_mean"] >= 1 - n * np.finfo(np.float32).eps
    # One Gaussian tangent: about sqrt(2/(pi n)) (the theory's own spread over s keys).
    gap = abs(w[K1]["cosine_mean"] - gaussian_cosine_approx(n))
    assert gap <= nbc.Z * gaussian_cosine_std(n) / math.sqrt(s), gap
    # K tangents: about E[chi_K]/sqrt(n).
    k = c["num_tangents"][K16]
    assert abs(w[K16]["cosine_mean"] - chi_mean(k) / math.sqrt(n)) <= nbc.Z * se(K16)
    # More tangents raise the cosine.
    assert nbc.exceeds(w[K16]["cosine_mean"] - w[K1]["cosine_mean"], se(K16, K1))
    # weighted: the highest cosine of all the estimators but backprop.
    for e in w:
        if e not in ("backprop", WEIGHTED):
            assert nbc.exceeds(w[WEIGHTED]["cosine_mean"] - w[e]["cosine_mean"], se(WEIGHTED, e)), e
    # control_variate: near a single tangent's cosine.
    assert abs(w[CV]["cosine_mean"] - w[K1]["cosine_mean"]) <= nbc.Z * se(CV, K1)
    # Both hybrids unbiased: the 16-key mean's distance from g is within its noise. Its square
    # over the estimated variance of a mean is at most F(1, s-1) (one effective direction, the
    # worst case; more directions concentrate it near 1).
    bound = stats.f.ppf(1 - nbc.ALPHA, 1, s - 1)
    for e in c["hybrids"]:
        assert s * w[e]["bias"] ** 2 / w[e]["relative_variance"] <= bound, (e, w[e])
    check_families(c["families"], s)


def check_families(f: dict[str, Any], s: int) -> None:
    """jvp, SPSA and rank-1 jvp at K = 1, 4, 16: cosines and costs in forward passes."""
    se = lambda *names: math.sqrt(sum(f[e]["cosine_std"] ** 2 for e in names) / s)
    cos = lambda e: f[e]["cosine_mean"]
    for k in (1, 4, 16):
        jvp, zo, low = f"jvp K={k}", f"spsa K={k}", f"jvp rank-1 K={k}"
        # SPSA: exactly two forward passes per direction (matmul FLOPs, loops counted)
        assert f[zo]["passes"] == pytest.approx(2 * k, rel=1e-9)
        # the same K: SPSA's and the rank-1 tangents' cosines are the jvp's within noise
        assert abs(cos(zo) - cos(jvp)) <= nbc.Z * se(zo, jvp), k
        assert abs(cos(low) - cos(jvp)) <= nbc.Z * se(low, jvp), k
        assert f[low]["passes"] == pytest.approx(f[jvp]["passes"], rel=1e-9)
    for fam in ("jvp", "spsa", "jvp rank-1"):  # more directions raise the cosine
        assert nbc.exceeds(cos(f"{fam} K=16") - cos(f"{fam} K=1"), se(f"{fam} K=16", f"{fam} K=1"))
    # the first tangent costs more than two passes, further ones share the primal
    assert f["jvp K=1"]["passes"] > f["spsa K=1"]["passes"]
    assert f["jvp K=16"]["passes"] < f["spsa K=16"]["passes"]


def test_committed_with_outputs_whose_claims_hold():
    nb = nbc.committed(NOTEBOOK)
    assert nbc.unexecuted(nb) == []
    assert nbc.images(nb) >= 2
    check_claims(nbc.claims(nb))


@pytest.mark.slow  # executes the notebook: a minute or two on 2 CPU cores
def test_notebook_runs_and_its_claims_hold(monkeypatch):
    nb = nbc.execute(NOTEBOOK, monkeypatch)
    out = nbc.text(nb)
    assert "forward K=1" in out and "cosine" in out and "theory sqrt(2/(pi n))" in out
    assert nbc.images(nb) >= 2
    check_claims(nbc.claims(nb))
