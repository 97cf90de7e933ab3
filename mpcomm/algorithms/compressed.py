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

The compressed reduce-scatter (``comm.reduce_scatter(send, recv, wire=...)``, FSDP's gradient reduction) is the
first half of that exchange over all ranks, on the caller's equal chunks: each rank encodes chunk j of its send
buffer once (chunk j on its own: an int8 chunk's blocks start at the chunk's start) and sends it to rank j; rank j
decodes the p contributions, its own included, adds them in float32 in rank order and finishes (avg: / p). So on
rank j, bit for bit::

    recv = sum over ranks k in order of roundtrip(send_k[chunk j]) [/ p]

one rounding per contribution and none of the sum (it stays on its rank): a rank's own loss,
``send - roundtrip(chunk by chunk)``, is exactly what the wire took from it (FSDP's error feedback keeps that).
Every rank sends compressed, on one node or many (no node-local float32 stage: the sum of a node's ranks would be
rounded once for all of them, and a rank's own loss would no longer be what it kept).
"""
from __future__ import annotations

import numpy as np

from ..buffers import ReduceOp
from ..compression import Codec
from ..transport import Transport
from .chunks import aligned_bounds, equal_bounds
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
    payload, places = encode_chunks(t, buf, bounds, codec)
    mine = buf[slice(*bounds[r])]
    reduce_own_chunk(t, payload, places, mine, op, codec)
    codec.encode(mine, payload[slice(*places[r])])
    all_gather_chunks(t, payload, places)
    for (lo, hi), (start, stop) in zip(bounds, places):
        codec.decode(payload[start:stop], buf[lo:hi])


def reduce_scatter(t: Transport, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, codec: Codec) -> None:
    """``recvbuf`` <- the compressed reduction of chunk ``t.rank`` of every rank's ``sendbuf`` (contiguous 1-D
    float32, ``sendbuf.size == t.size * recvbuf.size``; see the module docstring)."""
    payload, places = encode_chunks(t, sendbuf, equal_bounds(recvbuf.size, t.size), codec)
    reduce_own_chunk(t, payload, places, recvbuf, op, codec)


def encode_chunks(t: Transport, buf: np.ndarray, bounds: list[tuple[int, int]],
                  codec: Codec) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Every chunk of ``buf`` encoded once, one after another in a scratch payload; and where each lies in it."""
    places = payload_bounds(codec, bounds)
    payload = t.scratch("compressed.payload", places[-1][1], np.uint8, like=buf)
    for (lo, hi), (start, stop) in zip(bounds, places):
        codec.encode(buf[lo:hi], payload[start:stop])
    return payload, places


def reduce_own_chunk(t: Transport, payload: np.ndarray, places: list[tuple[int, int]], out: np.ndarray,
                     op: ReduceOp, codec: Codec) -> None:
    """``out`` <- every rank's encoded chunk ``t.rank`` decoded and added in float32 in rank order, finished."""
    parts = in_rank_order(t.rank, exchange_segments(t, payload, places))
    codec.decode(parts[0], out)
    for part in parts[1:]:
        codec.accumulate(part, out)
    op.finish(out)


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
