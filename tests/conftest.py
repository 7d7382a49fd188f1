"""Test set-up: eight simulated CPU devices for the sharded engines.

XLA reads the flag once, when JAX first initialises its backends, so it is set here,
before any test module imports JAX.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")
