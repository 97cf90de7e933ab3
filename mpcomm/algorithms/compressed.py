"""All-reduce with a compressed wire between nodes (``comm.allreduce(buf, wire="bf16"|"fp16"|"int8")``), float32
everywhere else.

What is compressed is what crosses the network: when every node holds the same number q of ranks, each node
first sums its ranks' vectors in float32 (shared memory; chunk i of the node's sum ends on node-local rank i),
then the ranks with the same node-local index run the compressed exchange below over their chunk, one rank per
node, and each node all-gathers the finished chunks in float32. Otherwise (nodes of different sizes) every rank
is its own group and the compressed exchange runs over all ranks.

The compressed exchange among g group members: each encodes its vector once, chunk by chunk (chunks cut at the
codec's block edges, so pieces encode as the whole would), and sends chunk j to member j
(``direct.post_exchange``); member j decodes the g contributions, adds them in float32 in member order, finishes
(avg: divides by the communicator size), encodes the sum once, and the encoded chunks are all-gathered
(``direct.post_all_gather``) and decoded by every member, its own chunk included. So on every rank, bit for bit::

    result = roundtrip( sum over groups in order of roundtrip(group's float32 sum in rank order) [/ p] )

with ``roundtrip`` the codec's (one node: both roundings of the one sum; one rank per node: of each rank's input).
Chosen over recompressing the partial sums at every ring hop: the same bytes and about the same codec passes, but
one rounding per contribution instead of p - 1 of growing partial sums (measured: bench/results/compression.md).

The vector goes through all of this in segments of ``SEGMENT_BYTES`` (cut at block edges, so the bits above do
not change), software-pipelined three deep: while one segment's compressed exchange and the previous one's
gather are on the wire, this rank sums the next segment in its node and encodes it, so the node's float32 phases
and the codec passes overlap the transfers between nodes instead of running before and after them. At step i a
rank (1) sums segment i in the node, encodes it and posts its exchange, (2) waits for segment i - 1's exchange,
decodes, adds, encodes the sum and posts its gather, (3) waits for segment i - 2's gather, decodes it and gathers
it in the node. What a step waits for was posted a step earlier, by every rank, so the schedule cannot deadlock.

The compressed reduce-scatter (``comm.reduce_scatter(send, recv, wire=...)``, FSDP's gradient reduction) is the
first half of the exchange over all ranks, on the caller's equal chunks, in one piece: each rank encodes chunk j of
its send buffer once (chunk j on its own: an int8 chunk's blocks start at the chunk's start) and sends it to rank j;
rank j decodes the p contributions, its own included, adds them in float32 in rank order and finishes (avg: / p).
So on rank j, bit for bit::

    recv = sum over ranks k in order of roundtrip(send_k[chunk j]) [/ p]

one rounding per contribution and none of the sum (it stays on its rank): a rank's own loss,
``send - roundtrip(chunk by chunk)``, is exactly what the wire took from it (FSDP's error feedback keeps that).
Every rank sends compressed, on one node or many (no node-local float32 stage: the sum of a node's ranks would be
rounded once for all of them, and a rank's own loss would no longer be what it kept).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from ..buffers import ReduceOp
from ..compression import Codec
from ..transport import Transport
from .chunks import aligned_bounds, equal_bounds
from .direct import exchange_segments, post_all_gather, post_exchange
from .ring import all_gather_chunks

# float32 bytes of the vector per pipeline segment: small enough that the first exchange starts early and a
# segment's messages fit the sockets' buffers while this rank computes (MPI over TCP moves data beyond them only
# inside MPI calls), large enough that the per-message cost stays small (bench/results/compression.md).
SEGMENT_BYTES = 8 << 20
IN_FLIGHT = 3  # segments between their first and last step: one per step of the schedule
_EXCHANGE, _GATHER = 1, 2  # message tags: each stream stays in order while the other overtakes it


def allreduce(t: Transport, buf: np.ndarray, op: ReduceOp, codec: Codec) -> None:
    """In place on a contiguous 1-D float32 ``buf``; ``op`` is sum or avg (divisor: the communicator size)."""
    if t.size == 1 or not t.nodes_are_uniform:
        pipeline(t, None, t, buf, op, codec)
        return
    node, cross = t.node, t.cross
    with node.running(t.operation), cross.running(t.operation):
        pipeline(t, node if node.size > 1 else None, cross, buf, op, codec)


def pipeline(t: Transport, node: Transport | None, cross: Transport, buf: np.ndarray, op: ReduceOp,
             codec: Codec) -> None:
    """``buf`` summed in ``node`` (None: it is its own group), then over ``cross`` compressed, segment by segment;
    the steps' parts marked as phases of ``t`` (the timeline's)."""
    seg = max(1, SEGMENT_BYTES // buf.itemsize // codec.block) * codec.block
    segments = [buf[lo : lo + seg] for lo in range(0, buf.size, seg)]
    if not segments:
        return
    # the segments' scratch: rotating slots sized for the first (the largest) segment
    first = Segment(t, node, cross, segments[0], op, codec)
    payload = cross.scratch("compressed.payload", IN_FLIGHT * first.payload_bytes, np.uint8, like=buf)
    received = cross.scratch("compressed.received", IN_FLIGHT * first.received_bytes, np.uint8, like=buf)
    slots = [(payload[i * first.payload_bytes :][: first.payload_bytes],
              received[i * first.received_bytes :][: first.received_bytes]) for i in range(IN_FLIGHT)]
    started: list[Iterator[None]] = []  # newest first: every step advances them in that order
    for i, segment in enumerate(segments):
        started.insert(0, Segment(t, node, cross, segment, op, codec).run(*slots[i % IN_FLIGHT]))
        started = [s for s in started if _advance(s)]
    while started:
        started = [s for s in started if _advance(s)]


def _advance(steps: Iterator[None]) -> bool:
    """Run a segment's next step; False once it has finished."""
    return next(steps, False) is None


class Segment:
    """One segment's way through the pipeline (``run`` yields where it waits for the wire)."""

    def __init__(self, t: Transport, node: Transport | None, cross: Transport, segment: np.ndarray, op: ReduceOp,
                 codec: Codec):
        self.phase, self.node, self.cross, self.segment, self.op, self.codec = t.phase, node, cross, segment, op, codec
        self.node_bounds = aligned_bounds(segment.size, 1 if node is None else node.size, codec.block)
        self.mine = segment[slice(*self.node_bounds[0 if node is None else node.rank])]
        self.bounds = aligned_bounds(self.mine.size, cross.size, codec.block)
        self.places = payload_bounds(codec, self.bounds)
        self.payload_bytes = self.places[-1][1]
        start, stop = self.places[cross.rank]
        self.received_bytes = (cross.size - 1) * (stop - start)

    def run(self, payload: np.ndarray, received: np.ndarray) -> Iterator[None]:
        """The three steps, in ``payload`` / ``received`` (this segment's slot of the scratch)."""
        node, cross, codec, mine, phase = self.node, self.cross, self.codec, self.mine, self.phase
        if node is not None:
            with phase("sum in the node"):
                add_in_rank_order(node, exchange_segments(node, self.segment, self.node_bounds), mine)
        with phase("encode"):
            for (lo, hi), (start, stop) in zip(self.bounds, self.places):
                codec.encode(mine[lo:hi], payload[start:stop])
        parts, pending = post_exchange(cross, payload, self.places, received[: self.received_bytes], _EXCHANGE)
        yield
        with phase("wait for the exchange"):
            cross.wait(*pending)
        with phase("decode, add, encode"):
            own = mine[slice(*self.bounds[cross.rank])]
            sum_decoded(in_rank_order(cross.rank, parts), own, self.op, codec)
            codec.encode(own, payload[slice(*self.places[cross.rank])])
        pending = post_all_gather(cross, payload, self.places, _GATHER)
        yield
        with phase("wait for the gather"):
            cross.wait(*pending)
        with phase("decode"):
            for (lo, hi), (start, stop) in zip(self.bounds, self.places):
                codec.decode(payload[start:stop], mine[lo:hi])
        if node is not None:
            with phase("gather in the node"):
                all_gather_chunks(node, self.segment, self.node_bounds)


def reduce_scatter(t: Transport, sendbuf: np.ndarray, recvbuf: np.ndarray, op: ReduceOp, codec: Codec) -> None:
    """``recvbuf`` <- the compressed reduction of chunk ``t.rank`` of every rank's ``sendbuf`` (contiguous 1-D
    float32, ``sendbuf.size == t.size * recvbuf.size``; see the module docstring)."""
    bounds = equal_bounds(recvbuf.size, t.size)
    places = payload_bounds(codec, bounds)
    payload = t.scratch("compressed.payload", places[-1][1], np.uint8, like=sendbuf)
    for (lo, hi), (start, stop) in zip(bounds, places):
        codec.encode(sendbuf[lo:hi], payload[start:stop])
    sum_decoded(in_rank_order(t.rank, exchange_segments(t, payload, places)), recvbuf, op, codec)


def sum_decoded(parts: list, out: np.ndarray, op: ReduceOp, codec: Codec) -> None:
    """``out`` <- the payloads ``parts`` (in rank order) decoded and added in float32 in that order, finished."""
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
