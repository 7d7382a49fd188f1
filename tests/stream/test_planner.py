"""Planner: the cost model of the design notes, checked against its closed form."""

from __future__ import annotations

import argparse
import math

import jax
import numpy as np
import pytest

from jaxstream.experiment.plan_cli import add_plan_parser, main_plan
from jaxstream.models import mlp
from jaxstream.stream.planner import LayerCost, layer_cost, plan


def test_min_batch_hides_io():
    cost = LayerCost(param_bytes=4 << 20, flops_per_sample=3e6, activation_bytes_per_sample=4096,
                     num_layers=10)
    p = plan(cost, device_flops=1e12, read_bandwidth=2e9, device_memory=1e9, prefetch=2)
    assert p.min_batch == math.ceil((4 << 20) * 1e12 / (3e6 * 2e9))
    assert p.compute_time_per_layer >= p.read_time_per_layer
    smaller = plan(cost, device_flops=1e12, read_bandwidth=2e9, device_memory=1e9, batch=p.min_batch - 1)
    assert smaller.compute_time_per_layer < smaller.read_time_per_layer
    assert math.isclose(p.step_time, 10 * p.compute_time_per_layer)
    assert p.activation_bytes == p.batch * 4096


def test_memory_caps_batch_and_errors():
    cost = LayerCost(4 << 20, 3e6, 1 << 20, 10)
    p = plan(cost, device_flops=1e12, read_bandwidth=2e9, device_memory=32 << 20, prefetch=2)
    assert p.io_bound and p.device_bytes <= 32 << 20
    with pytest.raises(ValueError, match="read_bandwidth must be > 0"):
        plan(cost, device_flops=1e12, read_bandwidth=0, device_memory=1e9)
    with pytest.raises(ValueError, match="lower prefetch"):
        plan(cost, device_flops=1e12, read_bandwidth=1e9, device_memory=8 << 20, prefetch=4)
    with pytest.raises(ValueError, match=r"prefetch\+1=1 layers .*; use a smaller layer") as e:
        plan(cost, device_flops=1e12, read_bandwidth=1e9, device_memory=1 << 20, prefetch=0)
    assert "lower prefetch" not in str(e.value)  # nothing to lower


def test_layer_cost_of_mlp_matches_formula():
    stack = mlp(16, 32, 3, 4)
    params = jax.eval_shape(stack.init, jax.random.key(0))
    cost = layer_cost(stack, params, {"x": jax.ShapeDtypeStruct((8, 16), np.float32)}, tangents=1)
    assert cost.param_bytes == (32 * 32 + 32) * 4
    assert 0.5 * 3 * 2 * 32 * 32 <= cost.flops_per_sample <= 2 * 3 * 2 * 32 * 32 + 3 * 200


def test_plan_cli(capsys, tmp_path):
    ap = argparse.ArgumentParser()
    add_plan_parser(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["plan", "--width", "64", "--depth", "4", "--device-flops", "1e10",
                          "--read-bandwidth", "1e9", "--json", str(tmp_path / "p.json")])
    assert main_plan(args) == 0
    out = capsys.readouterr().out
    assert "smallest batch hiding I/O" in out and (tmp_path / "p.json").exists()
