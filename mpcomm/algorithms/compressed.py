"""All-reduce with a compressed wire between nodes (``comm.allreduce(buf, wire="bf16"|"fp16"|"int8")``), float32
everywhere else.

What is compressed is what crosses the network: when every node holds the same number q of ranks, each node
first sums its ranks' vectors in float32 (shared memory; chunk i of the node's sum ends on node-local rank i),
then the ranks with the same node-local index run the compressed exchange below over their chunk, one rank per
node, and each node all-gathers the finished chunks in float32. Otherwise (nodes of different sizes) every rank
is its own group and the compressed exchange runs over all ranks.

The compressed exchange (``exchange``) among g group members: each encodes its vector once, chunk by chunk
(chunks cut at the codec's block edges, so pieces encode as the whole would), and sends chunk j to member j
(``direct.exchange_segments``); member j decodes the g contributions, adds them in float32 in member order,
finishes (avg: divides by the communicator size), encodes the sum once, and the encoded chunks go round a ring
all-gather that every member decodes, its own chunk included. So on every rank, bit for bit::

    result = roundtrip( sum over groups in order of roundtrip(group's float32 sum in rank order) [/ p] )

with ``roundtrip`` the codec's (one node: both roundings of the one sum; one rank per node: of each rank's input).
Chosen over recompressing the partial sums at every ring hop: the same bytes and about the same codec passes, but
one rounding per contribution instead of p - 1 of growing partial sums (measured: bench/results/compression.md).
"""
from __future__ import annotations

import numpy as np

from ..buffers import ReduceOp
from ..compression import Codec
from ..transport import Transport
from .chunks import aligned_bounds
from .direct import exchange_segments
from .ring import all_gather_chunks


def allreduce(t: Transport, buf: np.ndarray, op: ReduceOp, codec: Codec) -> None:
    """In place on a contiguous 1-D float32 ``buf``; ``op`` is sum or avg (divisor: the communicator size)."""
    if t.size == 1 or not t.nodes_are_uniform:
        exchange(t, buf, op, codec)
        return
    node, cross = t.node, t.cross
    with node.running(t.operation), cross.running(t.operation):
        bounds = aligned_bounds(buf.size, node.size, codec.block)
        mine = buf[slice(*bounds[node.rank])]
        add_in_rank_order(node, exchange_segments(node, buf, bounds), mine)
        exchange(cross, mine, op, codec)
        all_gather_chunks(node, buf, bounds)


def exchange(t: Transport, buf: np.ndarray, op: ReduceOp, codec: Codec) -> None:
    """The compressed all-reduce among the ranks of ``t`` (see the module docstring)."""
    r = t.rank
    bounds = aligned_bounds(buf.size, t.size, codec.block)
    places = payload_bounds(codec, bounds)
    payload = t.scratch("compressed.payload", places[-1][1], np.uint8, like=buf)
    for (lo, hi), (start, stop) in zip(bounds, places):
        codec.encode(buf[lo:hi], payload[start:stop])
    parts = in_rank_order(r, exchange_segments(t, payload, places))
    mine = buf[slice(*bounds[r])]
    codec.decode(parts[0], mine)
    for part in parts[1:]:
        codec.accumulate(part, mine)
    op.finish(mine)
    codec.encode(mine, payload[slice(*places[r])])
    all_gather_chunks(t, payload, places)
    for (lo, hi), (start, stop) in zip(bounds, places):
        codec.decode(payload[start:stop], buf[lo:hi])


def payload_bounds(codec: Codec, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where each chunk's payload lies in the buffer of all of them, laid out in chunk order."""
    out, start = [], 0
    for lo, hi in bounds:
        stop = start + codec.wire_nbytes(hi - lo)
        out.append((start, stop))
        start = stop
    return out


def in_rank_order(rank: int, parts: list) -> list:
    """``exchange_segments``' parts (this rank's own first, then the others' in rank order) in rank order."""
    return [*parts[1 : rank + 1], parts[0], *parts[rank + 1 :]]


def add_in_rank_order(t: Transport, parts: list, out: np.ndarray) -> None:
    """``out`` (this rank's own part, ``parts[0]``) <- the float32 sum of ``parts`` (as ``exchange_segments``
    gives them) added in rank order."""
    ordered = in_rank_order(t.rank, parts)
    if out.size == 0 or len(ordered) == 1:
        return
    # rank >= 2: the sum of the first parts must not overwrite this rank's part before it is added
    acc = out if t.rank < 2 else t.scratch("compressed.sum", out.size, out.dtype, like=out)
    np.add(ordered[0], ordered[1], out=acc)
    for part in ordered[2:]:
        np.add(acc, part, out=acc)
    if acc is not out:
        np.copyto(out, acc)
