"""A tiny causal GPT (nnx.MultiHeadAttention) whose head reuses its embedding table, trained
by jaxstream and by plain nnx + optax from one initialisation: one parameter, equal training."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import tied_model as tm


@pytest.mark.standard_promotion  # plain nnx + optax, as a user trains it
def test_a_tied_gpt_trains_as_plain_nnx_trains_it():
    result = tm.main(["--steps", "3"])
    for opt in ("sgd", "adam"):
        r = result[opt]
        assert r["params_jaxstream"] == r["params_plain_nnx"] < r["params_if_untied"]
        assert r["head_table_is_embedding"]
        assert r["max_abs_diff_tied_table"] <= 1e-6 < r["tied_table_moved_by"]
    # with SGD every leaf agrees (Adam turns the attention key bias's zero gradient, float
    # noise, into steps of about the learning rate; see benchmarks/tied_model.py)
    assert result["sgd"]["max_abs_diff_all_leaves"] <= 1e-6
