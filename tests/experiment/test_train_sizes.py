"""A data section's train size, computed without loading (the batch check before any write),
equals the loaded data set's."""

from __future__ import annotations

import pytest

from jaxstream.experiment.data_configs import (
    CharsDataConfig,
    DigitsDataConfig,
    MNIST1DDataConfig,
)


@pytest.mark.parametrize("cfg", [
    DigitsDataConfig(test_fraction=0.33), DigitsDataConfig(),
    MNIST1DDataConfig(num_samples=333, train_split=0.55), MNIST1DDataConfig(num_samples=27,
                                                                            train_split=0.33),
    CharsDataConfig(seq_len=8, num_train=50, num_test=10),
])
def test_train_size_without_loading_equals_the_loaded_split(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # MNIST-1D generated afresh
    assert cfg.train_size(0) == len(cfg.load(0).train["y"])
