"""``engine.peer_timeout_s`` of the composed engine: read from the config, refused by name when
it is not a positive number of seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxstream.experiment.runner import load_experiment

CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "pipeline_stream.yaml"


def test_peer_timeout_is_read_and_defaults_below_half_of_jax_heartbeat_timeout():
    assert load_experiment(CONFIG)[1].engine.peer_timeout_s < 100 / 2
    assert load_experiment(CONFIG, ["engine.peer_timeout_s=12.5"])[1].engine.peer_timeout_s == 12.5


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_peer_timeout_that_is_not_positive_is_named(value):
    with pytest.raises(ValueError, match=r"engine\.peer_timeout_s"):
        load_experiment(CONFIG, [f"engine.peer_timeout_s={value}"])
