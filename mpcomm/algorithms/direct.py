"""Direct reduce-scatter, then a direct all-gather: every rank receives the other ranks' parts of its segment at
once and reduces all p of them in one pass, then sends its reduced segment to every other rank at once.

The bytes are the ring's (each rank sends and receives 2(p-1)/p of the vector), in two exchanges where the ring
takes 2(p - 1) steps. Across nodes the all-gather is the ring's: its p - 1 steps carry (p - 1)/p of the vector
over a node's link, the direct one q(p - q)/p with q ranks on a node. What it is for is the one pass: a segment's
p contributions meet on one rank, so float16 and bfloat16 travel as they are (half the bytes of the float32 the
other algorithms widen them to) and are added in float32 and rounded once (``mpcomm.kernels``). Each segment is
reduced on one rank, in a fixed order (its own part first, then the others' in rank order), and copied to the
rest, so the result is bitwise identical everywhere.
"""
from __future__ import annotations

from ..buffers import ReduceOp
from ..kernels import reduce_chunks
from ..transport import Transport
from .chunks import chunk_bounds, equal_bounds
from .ring import all_gather_chunks


def exchange_segments(t: Transport, src, bounds) -> list:
    """Every rank's part ``src[bounds[rank]]`` of this rank's segment: this rank's own (a view of ``src``) first,
    then the others' in rank order (views of a scratch buffer)."""
    lo, hi = bounds[t.rank]
    received = t.scratch("direct.recv", (t.size - 1) * (hi - lo), src.dtype, like=src)
    parts, pending = post_exchange(t, src, bounds, received)
    t.wait(*pending)
    return parts


def post_exchange(t: Transport, src, bounds, received, tag: int = 0) -> tuple[list, tuple]:
    """``exchange_segments``' messages posted, receiving into ``received`` ((p - 1) parts): its parts (filled once
    the messages are done) and the arguments of the ``Transport.wait`` for them."""
    p, r = t.size, t.rank
    lo, hi = bounds[r]
    size = hi - lo
    others = [j for j in range(p) if j != r]
    parts = [received[i * size : (i + 1) * size] for i in range(p - 1)]
    destinations = [(r + s) % p for s in range(1, p)]  # staggered, so no rank is everyone's first destination
    requests = [t.irecv(part, j, tag) for part, j in zip(parts, others)]
    requests += [t.isend(src[slice(*bounds[j])], j, tag) for j in destinations]
    expected = [size * src.itemsize] * (p - 1) + [None] * (p - 1)
    return [src[lo:hi], *parts], (requests, others + destinations, expected)


def post_all_gather(t: Transport, buf, bounds, tag: int = 0) -> tuple:
    """An all-gather in place posted at once (this rank's chunk ``buf[bounds[rank]]`` to every other rank, theirs
    into place): the ring's bytes in one step, for a caller that works while it runs. The ``Transport.wait``
    arguments."""
    p, r = t.size, t.rank
    others = [(r + s) % p for s in range(1, p)]
    requests = [t.irecv(buf[slice(*bounds[j])], j, tag) for j in others]
    requests += [t.isend(buf[slice(*bounds[r])], j, tag) for j in others]
    expected = [(bounds[j][1] - bounds[j][0]) * buf.itemsize for j in others] + [None] * (p - 1)
    return requests, others + others, expected


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    bounds = chunk_bounds(buf.size, t.size)
    mine = buf[slice(*bounds[t.rank])]
    reduce_chunks(exchange_segments(t, buf, bounds), mine, op)
    if t.spans_nodes:
        all_gather_chunks(t, buf, bounds)
    else:
        t.wait(*post_all_gather(t, buf, bounds))


def reduce_scatter(t: Transport, sendbuf, recvbuf, op: ReduceOp) -> None:
    reduce_chunks(exchange_segments(t, sendbuf, equal_bounds(recvbuf.size, t.size)), recvbuf, op)
