"""Stage placement: exact optimum against brute force; clear errors."""

import itertools

import numpy as np
import pytest

from jaxstream.placement import evaluate_placement, place_stages, uniform_placement


def _brute_force(costs, speeds):
    num_layers, num_stages = len(costs), len(speeds)
    best = np.inf
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        best = min(best, evaluate_placement(costs, speeds, sizes).slowest)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_optimal_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    costs = rng.uniform(0.1, 5.0, size=rng.integers(4, 10))
    speeds = rng.choice([0.5, 1.0, 2.0, 4.0], size=rng.integers(1, min(5, len(costs)) + 1))
    placement = place_stages(costs, speeds)
    assert sum(placement.sizes) == len(costs) and min(placement.sizes) >= 1
    np.testing.assert_allclose(placement.slowest, _brute_force(costs, speeds), rtol=1e-12)
    assert placement.slowest <= uniform_placement(costs, speeds).slowest + 1e-12
    assert placement.slowest >= placement.ideal * (1 - 1e-12)


def test_uneven_layers_balance_improves():
    costs = [1, 1, 4, 4, 1, 1, 2, 8, 1, 1, 1, 3]
    speeds = [1.0, 2.0, 1.0, 0.5]
    before, after = uniform_placement(costs, speeds), place_stages(costs, speeds)
    assert before.balance == pytest.approx(11.0 / 7.5)
    assert after.slowest == pytest.approx(8.0)
    assert after.balance < before.balance


def test_more_stages_than_layers_is_an_error():
    with pytest.raises(ValueError, match="more stages than layers"):
        place_stages([1.0, 2.0], [1.0, 1.0, 1.0])


def test_bad_speeds_are_an_error():
    with pytest.raises(ValueError, match="device_speeds"):
        place_stages([1.0, 2.0, 3.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="sizes must be"):
        evaluate_placement([1.0, 2.0, 3.0], [1.0, 1.0], [3, 0])
