"""Registers ``max_adabelief`` with the experiment runner (``optimizer: {name: max_adabelief}``)."""

from jaxstream.experiment.optimizers import register_optimizer
from jaxstream.optim.max_adabelief import max_adabelief

register_optimizer("max_adabelief", max_adabelief)
