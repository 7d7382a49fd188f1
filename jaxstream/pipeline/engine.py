"""Deprecated alias: this module moved (see :mod:`jaxstream._moved` for where); importing it
warns and gives the new module."""

from jaxstream._moved import _ALIASES, moved

moved(__name__, _ALIASES[__name__])
