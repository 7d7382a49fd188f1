"""What a streamed sweep reads and runs, typed: the embed, the head, or a block unit of one or
more consecutive layers (a :class:`~jaxstream.stream.placement.Placement` decides how many).

A unit is not a store address: the store keeps the embed, the head and each layer apart
(:data:`LayerKey`: ``"embed"``, ``"head"`` or a layer index), and a block unit of M layers
reads M of them. Gradients are handed back per :data:`LayerKey`.

Example:
  >>> units = [EMBED, block(0), block(1), HEAD]
  >>> [u.keys for u in units]
  [('embed',), (0,), (1,), ('head',)]
"""

from __future__ import annotations

from typing import Literal, NamedTuple

LayerKey = str | int  # the store's address of the embed ("embed"), the head ("head") or a layer


class Unit(NamedTuple):
    """A unit of a streamed sweep.

    Attributes:
      part: ``"embed"``, ``"block"`` or ``"head"`` (the part of the model it runs).
      layers: a block unit's layers, in order (empty for the embed and the head).
    """

    part: Literal["embed", "block", "head"]
    layers: tuple[int, ...] = ()

    @property
    def is_block(self) -> bool:
        return self.part == "block"

    @property
    def keys(self) -> tuple[LayerKey, ...]:
        """The store addresses the unit reads, in order."""
        return self.layers if self.is_block else (self.part,)

    @property
    def key(self) -> LayerKey:
        """The one store address of the embed, the head or a one-layer unit."""
        if len(self.keys) != 1:
            raise ValueError(f"unit {self}: {len(self.keys)} layers have no single store key")
        return self.keys[0]

    def __str__(self) -> str:
        return self.part if not self.is_block else "layers " + ",".join(map(str, self.layers))


EMBED = Unit("embed")
HEAD = Unit("head")


def block(*layers: int) -> Unit:
    """The block unit of ``layers`` (consecutive, in order)."""
    return Unit("block", tuple(int(l) for l in layers))


def of_key(key: LayerKey) -> Unit:
    """The unit that reads one store address."""
    return Unit(key) if isinstance(key, str) else block(key)


def parse_key(name: str) -> LayerKey:
    """A store address from its persisted name (``"embed"``, ``"head"``, ``"3"``)."""
    return int(name) if name.isdigit() else name
