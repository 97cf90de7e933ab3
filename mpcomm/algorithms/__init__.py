"""The collective algorithms, one module each, as plain functions over a Transport.

Signatures (all buffers contiguous 1-D arrays of the same wire dtype; a buffer only the root uses may be None
elsewhere; counts and displacements in elements):
``allreduce(t, buf, op)`` in place; ``reduce_scatter(t, sendbuf, recvbuf, op)``;
``all_gather(t, sendbuf, recvbuf)``; ``broadcast(t, buf, root)``; ``reduce(t, sendbuf, recvbuf, op, root)``;
``gather(t, sendbuf, recvbuf, root)``; ``scatter(t, sendbuf, recvbuf, root)``;
``all_to_all[_v](t, sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs)``.
"""
from __future__ import annotations

from typing import Any, Callable

from . import bruck, direct, hierarchical, native, pairwise, pipelined, rhd, ring, tree

ALLREDUCE = {
    "ring": ring.allreduce,
    "tree": tree.allreduce,
    "rhd": rhd.allreduce,
    "hierarchical": hierarchical.allreduce,
    "ring_pipelined": pipelined.allreduce,
    "direct": direct.allreduce,
    "native": native.allreduce,
}
REDUCE_SCATTER = {
    "ring": ring.reduce_scatter,
    "rhd": rhd.reduce_scatter,
    "ring_pipelined": pipelined.reduce_scatter,
    "direct": direct.reduce_scatter,
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
REDUCE = {
    "tree": tree.reduce_to,
    "rhd": rhd.reduce,
    "native": native.reduce,
}
GATHER = {
    "tree": tree.gather,
    "native": native.gather,
}
SCATTER = {
    "tree": tree.scatter,
    "native": native.scatter,
}
ALL_TO_ALL = {
    "pairwise": pairwise.all_to_all,
    "bruck": bruck.all_to_all,
    "native": native.all_to_all,
}
ALL_TO_ALL_V = {
    "pairwise": pairwise.all_to_all,  # per-peer counts need nothing more
    "bruck": bruck.all_to_all_v,
    "native": native.all_to_all_v,
}
# All-reduces whose calls on host arrays can be one C call each (Plan.express): algorithm -> (express(t, buf, op,
# totals): the call or None, complete(t, buf, op, outcome): the rest, where the call returned a request still running)
EXPRESS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {"native": (native.express, native.complete),
                                                                      "rhd": (rhd.express, rhd.complete)}
# Algorithms that take float16/bfloat16 host buffers as they are and accumulate in float32 themselves (the others
# get the buffer widened to float32 before they run and narrowed after).
KEEP_LOW_PRECISION = frozenset({"direct"})

REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {
    "allreduce": ALLREDUCE,
    "reduce_scatter": REDUCE_SCATTER,
    "all_gather": ALL_GATHER,
    "broadcast": BROADCAST,
    "reduce": REDUCE,
    "gather": GATHER,
    "scatter": SCATTER,
    "all_to_all": ALL_TO_ALL,
    "all_to_all_v": ALL_TO_ALL_V,
}
