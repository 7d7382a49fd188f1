"""Pipeline stages that stream their layers, with replicas beside them: one engine over a
``data × stage`` mesh (:class:`ComposedExecutor`)."""

from jaxstream.compose.cost import ChunkCost, chunk_cost
from jaxstream.compose.executor import ComposedExecutor, StageChunks
from jaxstream.compose.mesh import make_mesh
from jaxstream.compose.pipe import DATA, STAGE, build_pipe

__all__ = ["DATA", "STAGE", "ChunkCost", "ComposedExecutor", "StageChunks", "build_pipe",
           "chunk_cost", "make_mesh"]
