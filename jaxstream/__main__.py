"""``python -m jaxstream run experiments/X.yaml ...`` (same as the ``jaxstream`` command)."""

import sys

from jaxstream.cli import main

sys.exit(main())
