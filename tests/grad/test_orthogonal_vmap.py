"""Orthogonal tangents under ``jax.jit(jax.vmap(...))`` over many keys: the program the README
promises (every estimator vmappable over ``key``) finishes every time, and the tangents equal a
float64 NumPy reference (QR of the draws, dependent rows redrawn).

Before, the orthogonalisation was a batched LAPACK QR (two custom calls, geqrf and orgqr) that
XLA's CPU runtime ran at once, each waiting in its parallel batch loop for pool threads the
other held: 7 of 13 runs over 5,000–20,000 keys deadlocked (every thread on a futex)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxstream.grad.tangents import TangentSpec

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    import jaxstream as js
    n, seed, repeats = (int(a) for a in sys.argv[1:4])
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    batch = {"x": jnp.ones((4, 2))}
    loss = lambda p, b: jnp.sum((b["x"] @ p["w"]) ** 2)
    est = js.grad.forward(num_tangents=4, distribution="rademacher", orthogonal=True)
    f = jax.jit(jax.vmap(lambda k: est(loss, params, batch, k)))
    for r in range(repeats):
        jax.block_until_ready(f(jax.random.split(jax.random.key(seed * 100 + r), n)))
    print("done", repeats)
""")


@pytest.mark.slow
def test_vmapped_orthogonal_estimator_never_hangs():
    """The issue's program executed 60 times (3 processes × 20 runs, 5,000–20,000 keys), each
    process under a timeout far above its run time: none hangs. A process's time is its start
    and its one compile (a run after it takes a tenth of a second), so the runs are many and
    the processes few."""
    rng = np.random.default_rng(0)
    procs = [subprocess.Popen([sys.executable, "-c", PROGRAM, str(int(rng.integers(5000, 20001))),
                               str(i), "20"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    hung = []
    for i, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            hung.append(i)
            continue
        assert p.returncode == 0 and "done 20" in out, err[-2000:]
    assert not hung, f"processes {hung} hung"


def _reference(v: np.ndarray, spare: np.ndarray) -> tuple[np.ndarray, bool]:
    """float64 NumPy: rows at distance < 1e-3 √size from the span of the rows before them are
    replaced by ``spare``'s rows, then Q of a QR with a positive diagonal, rows scaled to √size;
    and whether a row was replaced."""
    k, size = v.shape
    dist = [np.linalg.norm(v[0])] + [
        np.linalg.norm(v[j] - v[:j].T @ np.linalg.lstsq(v[:j].T, v[j], rcond=None)[0])
        for j in range(1, k)]
    deficient = np.array(dist) < 1e-3 * np.sqrt(size)
    m = np.where(deficient[:, None], spare, v)
    q, r = np.linalg.qr(m.T)
    return (q * np.sign(np.diag(r))).T * np.sqrt(size), bool(deficient.any())


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
def test_orthogonal_tangents_equal_a_numpy_reference(distribution):
    """Under jit(vmap) over 200 keys, at leaf sizes where sign rows are often dependent (5, 6)
    and where they rarely are (8, 40): each key's K = 4 tangents equal the NumPy reference."""
    plain, orth = TangentSpec(4, distribution), TangentSpec(4, distribution, orthogonal=True)
    keys = jax.random.split(jax.random.key(5), 200)
    redrawn = 0
    for size in (5, 6, 8, 40):
        # the orthogonal tangents, the raw draws and the spare rows: one program per size
        draws = jax.jit(jax.vmap(lambda k, s=size: (
            orth.sample(k, (s,)), plain.sample(k, (s,)),
            jax.random.normal(jax.random.fold_in(k, 1), (4, s)))))(keys)
        got, raw, spare = map(np.asarray, draws)
        for g, v, sp in zip(got, raw, spare):
            want, replaced = _reference(v.astype(np.float64), sp.astype(np.float64))
            redrawn += replaced
            np.testing.assert_allclose(g, want, atol=2e-4 * np.sqrt(size))
            np.testing.assert_allclose(g @ g.T, size * np.eye(4), atol=1e-4 * size)
    if distribution == "rademacher":
        assert redrawn > 20  # the dependent-row path is exercised
