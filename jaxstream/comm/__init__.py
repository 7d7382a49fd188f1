"""Communication: ring all-reduce, compressed symmetric codecs, data parallelism, byte counts."""

from jaxstream.comm.dataparallel import DataParallel, data_parallel, device_keys
from jaxstream.comm.ring import (
    ring_all_reduce,
    ring_all_reduce_tree,
    ring_chunk_size,
    ring_wire_bytes,
)
from jaxstream.comm.symmetric import (
    CODECS,
    cholesky_decode,
    cholesky_encode,
    decode,
    encode,
    pack_lower,
    packed_size,
    unpack_lower,
    validate_symmetric,
)
from jaxstream.comm.symmetric_reduce import all_reduce_symmetric, send_symmetric, symmetric_traffic
from jaxstream.comm.traffic import Collective, collectives, traffic_summary

__all__ = [
    "CODECS",
    "Collective",
    "DataParallel",
    "all_reduce_symmetric",
    "cholesky_decode",
    "cholesky_encode",
    "collectives",
    "data_parallel",
    "decode",
    "device_keys",
    "encode",
    "pack_lower",
    "packed_size",
    "ring_all_reduce",
    "ring_all_reduce_tree",
    "ring_chunk_size",
    "ring_wire_bytes",
    "send_symmetric",
    "symmetric_traffic",
    "traffic_summary",
    "unpack_lower",
    "validate_symmetric",
]  # fmt: skip
