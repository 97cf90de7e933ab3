"""All-reduce with a compressed wire (``comm.allreduce(buf, wire="bf16"|"fp16"|"int8")``), float32 in between.

Each rank encodes its vector once, chunk by chunk (chunks cut at the codec's block edges), and sends chunk j to
rank j (``direct.exchange_segments``); rank j decodes the p contributions and adds them in float32 in rank order,
finishes (avg: divides), encodes the sum once and the encoded chunks go round a ring all-gather; every rank
decodes all of them, its own included. So the result is ``roundtrip(sum in rank order of roundtrip(x_rank))`` on
every rank, bit for bit, with one rounding of each input and one of the sum.
Chosen over recompressing at every ring hop (p - 1 roundings of the partial sums, p - 1 encodes per rank): the
same bytes on the wire, fewer codec passes, and the error of a single rounding (bench/results/compression.md).
"""
from __future__ import annotations

import numpy as np

from ..buffers import ReduceOp
from ..compression import Codec
from ..transport import Transport
from .chunks import aligned_bounds
from .direct import exchange_segments
from .ring import all_gather_chunks


def payload_bounds(codec: Codec, bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where each chunk's payload lies in the buffer of all of them, laid out in chunk order."""
    out, start = [], 0
    for lo, hi in bounds:
        stop = start + codec.wire_nbytes(hi - lo)
        out.append((start, stop))
        start = stop
    return out


def allreduce(t: Transport, buf: np.ndarray, op: ReduceOp, codec: Codec) -> None:
    """In place on a contiguous 1-D float32 ``buf``; ``op`` is sum or avg."""
    p, r = t.size, t.rank
    bounds = aligned_bounds(buf.size, p, codec.block)
    places = payload_bounds(codec, bounds)
    payload = t.scratch("compressed.payload", places[-1][1], np.uint8, like=buf)
    for (lo, hi), (start, stop) in zip(bounds, places):
        codec.encode(buf[lo:hi], payload[start:stop])
    parts = exchange_segments(t, payload, places)  # this rank's own first, then the others' in rank order
    in_rank_order = [*parts[1 : r + 1], parts[0], *parts[r + 1 :]]
    mine = buf[slice(*bounds[r])]
    codec.decode(in_rank_order[0], mine)
    for part in in_rank_order[1:]:
        codec.accumulate(part, mine)
    op.finish(mine)
    codec.encode(mine, payload[slice(*places[r])])
    all_gather_chunks(t, payload, places)
    for (lo, hi), (start, stop) in zip(bounds, places):
        codec.decode(payload[start:stop], buf[lo:hi])
