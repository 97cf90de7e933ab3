"""The collective algorithms, one module each, as plain functions over a Transport.

Signatures (all buffers contiguous 1-D arrays of the same wire dtype):
``allreduce(t, buf, op)`` in place; ``reduce_scatter(t, sendbuf, recvbuf, op)``;
``all_gather(t, sendbuf, recvbuf)``; ``broadcast(t, buf, root)``.
"""
from __future__ import annotations

from . import hierarchical, native, pipelined, rhd, ring, tree

ALLREDUCE = {
    "ring": ring.allreduce,
    "tree": tree.allreduce,
    "rhd": rhd.allreduce,
    "hierarchical": hierarchical.allreduce,
    "ring_pipelined": pipelined.allreduce,
    "native": native.allreduce,
}
REDUCE_SCATTER = {
    "ring": ring.reduce_scatter,
    "rhd": rhd.reduce_scatter,
    "ring_pipelined": pipelined.reduce_scatter,
    "native": native.reduce_scatter,
}
ALL_GATHER = {
    "ring": ring.all_gather,
    "rhd": rhd.all_gather,
    "native": native.all_gather,
}
BROADCAST = {
    "tree": tree.broadcast,
    "native": native.broadcast,
}

REGISTRY = {
    "allreduce": ALLREDUCE,
    "reduce_scatter": REDUCE_SCATTER,
    "all_gather": ALL_GATHER,
    "broadcast": BROADCAST,
}
