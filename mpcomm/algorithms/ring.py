"""Ring algorithms (Patarasuk & Yuan): reduce-scatter and all-gather in p-1 neighbour steps each.

All-reduce = reduce-scatter + all-gather; every rank sends and receives 2(p-1)/p of the vector, the
bandwidth-optimal amount. Each chunk is reduced along the ring and finished on exactly one rank, then
copied to all, so the result is bitwise identical everywhere.
"""
from __future__ import annotations

from ..buffers import ReduceOp
from ..kernels import combine
from ..transport import Transport
from .chunks import chunk_bounds, equal_bounds


def exchange_then_reduce(t: Transport, to_send, local, target, op: ReduceOp, finish: bool = False) -> None:
    """One ring step: send ``to_send`` right while receiving the left neighbour's partial of the chunk
    whose local part is ``local``; then ``target`` <- ``local`` (op) received (``finish``: finished, e.g. avg's
    division)."""
    p, r = t.size, t.rank
    received = t.scratch("ring.recv", local.size, local.dtype, like=local)
    t.sendrecv(to_send, (r + 1) % p, received, (r - 1) % p)
    combine(local, received, target, op, finish)


def reduce_scatter_chunks(t: Transport, src, out, op: ReduceOp, bounds, step=exchange_then_reduce,
                          finish: bool = False) -> None:
    """``out`` <- reduction over all ranks of ``src[bounds[rank]]`` (``finish``: finished by the last step, where
    the pipelined step finishes each segment while it is in cache); ``src`` is read only (``out`` may alias it).

    ``step(t, to_send, local, target, op, finish)`` performs one of the p-1 ring steps (see
    ``exchange_then_reduce``; ``pipelined.py`` passes a segmented one). ``target`` never aliases ``to_send``.
    """
    p, r = t.size, t.rank
    if p == 1:
        out[...] = src[slice(*bounds[r])]
        if finish:
            op.finish(out)
        return
    largest = max(stop - start for start, stop in bounds)
    partials = t.scratch("ring.partial", 2 * largest, src.dtype, like=src)
    to_send = src[slice(*bounds[(r - 1) % p])]
    for s in range(p - 1):
        lo, hi = bounds[(r - s - 2) % p]
        last = s == p - 2
        target = out if last else partials[(s % 2) * largest :][: hi - lo]
        step(t, to_send, src[lo:hi], target, op, finish and last)
        to_send = target


def all_gather_chunks(t: Transport, buf, bounds) -> None:
    """In place: each rank holds ``buf[bounds[rank]]``; afterwards every rank holds all chunks."""
    p, r = t.size, t.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_chunk, recv_chunk = (r - step) % p, (r - step - 1) % p
        t.sendrecv(buf[slice(*bounds[send_chunk])], right, buf[slice(*bounds[recv_chunk])], left)


def allreduce(t: Transport, buf, op: ReduceOp, reduce_scatter=reduce_scatter_chunks) -> None:
    """Reduce-scatter (``reduce_scatter``: this module's, or the pipelined one), finish, all-gather."""
    bounds = chunk_bounds(buf.size, t.size)
    mine = buf[slice(*bounds[t.rank])]
    with t.phase("reduce-scatter"):
        reduce_scatter(t, buf, mine, op, bounds, finish=True)
    with t.phase("all-gather"):
        all_gather_chunks(t, buf, bounds)


def reduce_scatter(t: Transport, sendbuf, recvbuf, op: ReduceOp) -> None:
    reduce_scatter_chunks(t, sendbuf, recvbuf, op, equal_bounds(recvbuf.size, t.size), finish=True)


def all_gather(t: Transport, sendbuf, recvbuf) -> None:
    bounds = equal_bounds(sendbuf.size, t.size)
    recvbuf[slice(*bounds[t.rank])] = sendbuf
    all_gather_chunks(t, recvbuf, bounds)
