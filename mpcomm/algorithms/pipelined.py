"""Pipelined (segmented) ring: every reduce-scatter step is cut into segments so that reducing segment k
overlaps the transfer of segment k+1 (the technique of NCCL's ring, Patarasuk & Yuan's ring with slicing).

The ring schedule itself is ``ring.reduce_scatter_chunks``; only the step differs. A step sends the
partial chunk right and receives the left neighbour's partial of the chunk this rank adds to, in
``segments`` messages of ``SEGMENT_BYTES``::

    post receive+send of segment 0
    for k in 0..segments-1:
        post receive+send of segment k+1      (into the other half of a double buffer)
        wait for segment k
        target[k] <- local[k] (op) received[k]   (while segment k+1 is on the wire)

The all-gather phase has no arithmetic to hide, so it is the plain ring's. The segment length is a fixed
number of elements, the same for every chunk, so sender and receiver agree on the messages even when
chunk sizes differ by one (the last segments of a short chunk may be short or empty).

How much the overlap buys depends on the MPI library making progress while this process computes:
MPICH and Open MPI move shared-memory messages inside the receiver's MPI calls, so on one host nothing
overlaps (at p = 2 on 2 cores it took 1.16-1.20x the plain ring at 8 MiB, bench/results/dtype_op.md "Stop 32"),
but from 32 MiB it leads there all the same: each segment is reduced while in cache, where the plain ring's chunk
has left it ("Stop 34"); across hosts the kernel moves the bytes while the rank reduces.
Oversubscribed ranks (more ranks than cores) make every extra message a scheduling round trip, and it loses.
"""
from __future__ import annotations

from functools import partial

from ..buffers import ReduceOp
from ..kernels import combine
from ..transport import Transport
from . import ring
from .chunks import equal_bounds

# Smaller segments pay their per-message Python and MPI cost too often, larger ones overlap too little
# (bench/results/observations.md, "Pipelined ring segments").
SEGMENT_BYTES = 1 << 20


def segmented_step(t: Transport, to_send, local, target, op: ReduceOp, finish: bool, seg: int, segments: int) -> None:
    """One ring step in ``segments`` messages of ``seg`` elements, reducing one (``finish``: and finishing it,
    while in cache) while the next is in flight."""
    p, r = t.size, t.rank
    right, left = (r + 1) % p, (r - 1) % p
    halves = t.scratch("pipelined.recv", 2 * seg, local.dtype, like=local)

    def piece(array, k):
        return array[min(k * seg, array.size) : min((k + 1) * seg, array.size)]

    def post(k):
        received = halves[(k % 2) * seg :][: piece(local, k).size]
        return received, [t.irecv(received, left), t.isend(piece(to_send, k), right)]

    pending = post(0)
    for k in range(segments):
        received, requests = pending
        if k + 1 < segments:
            pending = post(k + 1)
        t.wait(requests, (left, right), (received.nbytes, None))
        combine(piece(local, k), received, piece(target, k), op, finish)


def reduce_scatter_chunks(t: Transport, src, out, op: ReduceOp, bounds, segment_bytes: int | None = None,
                          finish: bool = False) -> None:
    """``ring.reduce_scatter_chunks`` with every step segmented (same arguments and result)."""
    largest = max(stop - start for start, stop in bounds)
    seg = max(1, (segment_bytes or SEGMENT_BYTES) // src.itemsize)
    segments = max(1, -(-largest // seg))
    step = partial(segmented_step, seg=seg, segments=segments)
    ring.reduce_scatter_chunks(t, src, out, op, bounds, step=step, finish=finish)


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    ring.allreduce(t, buf, op, reduce_scatter=reduce_scatter_chunks)


def reduce_scatter(t: Transport, sendbuf, recvbuf, op: ReduceOp) -> None:
    reduce_scatter_chunks(t, sendbuf, recvbuf, op, equal_bounds(recvbuf.size, t.size), finish=True)
