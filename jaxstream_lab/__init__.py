"""The lab: the forward table (``kind: forward_table``), its report, baselines and verdicts.

A research application built on the library, in a package beside it (installed by the same
``pip install -e .``): it uses the library's experiment layer (configs, runner, registry),
and nothing in ``jaxstream`` imports it.
It registers its experiment kind as a plugin (the entry point ``lab`` of the group
``jaxstream.plugins`` in ``pyproject.toml``), so ``jaxstream run experiments/forward_table.yaml``
finds it once the package is installed. Published figures it quotes are data
(``published.json``, with their source), not code.
"""

from jaxstream_lab import forward_table  # noqa: F401  (registers kind: forward_table)
