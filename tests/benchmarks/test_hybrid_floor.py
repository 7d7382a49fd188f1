"""The hybrid's redraw floor (benchmarks/hybrid_parts.py, jaxstream_lab.table_cost): its
``draws`` part sums exactly the tangents the step draws, its GEMM chain runs the forward pass's
matrix products and nothing more, and the floor is those FLOPs at the chain's rate plus two
rounds of the fastest draws."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxstream.grad import tangents as tg
from jaxstream.models import mlp
from jaxstream.quality.flops import matmul_flops
from jaxstream_lab.table_cost import redraw_floor, redraw_floor_text

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

N, WIDTH, DEPTH, BATCH = 4, 8, 3, 2


def _problem():
    stack = mlp(in_dim=WIDTH, width=WIDTH, depth=DEPTH, num_classes=3)
    params = stack.init(jax.random.key(0))
    micro = {"x": jax.random.normal(jax.random.key(1), (N, BATCH, WIDTH)),
             "y": jnp.zeros((N, BATCH), jnp.int32)}
    return stack, params, micro


def test_draws_part_sums_the_steps_tangents_and_the_chain_is_the_forward_products():
    from hybrid_parts import part_functions

    stack, params, micro = _problem()
    parts = part_functions(stack, N)
    key = jax.random.key(5)
    got = float(jax.jit(parts["draws"])(params, micro, key))
    want = 0.0  # every micro-batch's tangent tree, materialised and summed in float64
    for n in range(N):
        tree = tg.tangents(tg.TangentSpec(), tg.micro_key(key, n), params)
        want += sum(np.asarray(v, np.float64).sum() for v in jax.tree.leaves(tree))
    assert got == want != 0  # sums of ±1: exact in float32 at this size
    chain = jax.jit(parts["GEMM chain"]).lower(params, micro, key).compile()
    assert matmul_flops(chain) == 2 * N * BATCH * WIDTH * WIDTH * DEPTH


def test_the_hash_baseline_draws_the_same_tangents_at_a_size_that_takes_the_cpu_loop():
    """``draws by jax.random.bits`` sums the same signs as ``draws``, whose 384 x 384 kernels
    (4,608 words, above ``MIN_WORDS``) take :func:`~jaxstream.grad.threefry.random_words`' own
    hashing loop: the two hashes agree bit for bit there."""
    from hybrid_parts import part_functions

    from jaxstream.grad.threefry import MIN_WORDS

    width = 384
    assert width * width // 32 >= MIN_WORDS
    stack = mlp(in_dim=width, width=width, depth=2, num_classes=3)
    params = stack.init(jax.random.key(0))
    micro = {"x": jnp.zeros((2, 1, width)), "y": jnp.zeros((2, 1), jnp.int32)}
    parts = part_functions(stack, 2)
    ours, baseline = (int(jax.jit(parts[name])(params, micro, jax.random.key(9)))
                      for name in ("draws", "draws by jax.random.bits"))
    assert ours == baseline and abs(ours) > 0  # sums of ±1, exact in float32 at this size


def test_floor_is_the_flops_at_the_chain_rate_plus_two_fastest_draw_rounds():
    row = {"depth": 32, "flops": {"hybrid": 600}, "step_ms": {"backprop_remat": 40.0},
           "parts": {"GEMM chain": [0, 10.0, 200], "draws": [0, 7.0, 0],
                     "c own pass": [0, 6.0, 0], "sum into h": [0, 9.0, 0],
                     "exact sweep": [0, 1.0, 5]}}
    fl = redraw_floor(row)
    assert fl == {"matmul_ms": 30.0, "draws_ms": 12.0, "floor_ms": 42.0, "remat_ms": 40.0}
    assert "= 42 ms, above backprop+remat's 40 ms" in redraw_floor_text([row])
    row["step_ms"]["backprop_remat"] = 50.0
    assert "below backprop+remat's 50 ms" in redraw_floor_text([row])
    assert redraw_floor({"parts": {"draws": [0, 1.0, 0]}}) is None
