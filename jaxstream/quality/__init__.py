"""Gradient-quality lab: how close are gradient estimates to the exact gradient?

Measures of one estimate (cosine, norm ratio, relative error) and of R estimates over seeds
(bias, variance, SNR, cosine mean and spread), whole and per layer group; :func:`compare` runs
several estimators on the same model, batches and keys and returns a table that prints and
plots. The ``kind: grad_quality`` experiment lives in :mod:`jaxstream.experiment.quality_study` (imported
by the experiment runner, not here, to keep this package light).

Example:
  >>> import jaxstream.grad as jg
  >>> from jaxstream.quality import compare
  >>> table = compare({"forward": jg.forward(), "backprop": jg.backprop()}, stack, params, batch)
  >>> print(table); table.plot()
"""

from jaxstream.quality.baselines import ExactSubset, MicrobatchForward
from jaxstream.quality.compare import (
    compare,
    estimates_over_keys,
    evaluate,
    exact_gradient,
    flatten_microbatches,
)
from jaxstream.quality.flops import matmul_flops
from jaxstream.quality.groups import group_names, group_sums, num_parameters
from jaxstream.quality.metrics import (
    EstimateQuality,
    GradientError,
    SeedStatistics,
    cosine_similarity,
    estimate_quality,
    gradient_error,
    max_rel_err,
    seed_statistics,
)
from jaxstream.quality.table import QualityTable, format_table, save_rows
from jaxstream.quality.theory import (
    gaussian_cosine_approx,
    gaussian_cosine_mean,
    gaussian_cosine_std,
)

__all__ = [
    "EstimateQuality",
    "ExactSubset",
    "GradientError",
    "MicrobatchForward",
    "QualityTable",
    "SeedStatistics",
    "compare",
    "cosine_similarity",
    "estimate_quality",
    "estimates_over_keys",
    "evaluate",
    "exact_gradient",
    "flatten_microbatches",
    "format_table",
    "gaussian_cosine_approx",
    "gaussian_cosine_mean",
    "gaussian_cosine_std",
    "gradient_error",
    "group_names",
    "group_sums",
    "matmul_flops",
    "max_rel_err",
    "num_parameters",
    "save_rows",
    "seed_statistics",
]
