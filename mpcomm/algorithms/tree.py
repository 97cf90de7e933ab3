"""Binomial-tree algorithms: reduce to a root and broadcast from it, each in ceil(log2 p) rounds.

All-reduce = reduce to rank 0 + broadcast: latency-optimal for small messages (2 log p messages on the
critical path) but every round moves the whole vector, so it loses to ring/rhd on large ones.
"""
from __future__ import annotations

from ..buffers import ReduceOp
from ..transport import Transport


def reduce(t: Transport, buf, op: ReduceOp, root: int = 0) -> None:
    """Binomial reduce: afterwards ``buf`` on ``root`` holds the reduction (other ranks hold partial sums)."""
    p = t.size
    vrank = (t.rank - root) % p
    incoming = t.scratch("tree.recv", buf.size, buf.dtype, like=buf)
    mask = 1
    while mask < p:
        if vrank & mask:
            t.send(buf, (vrank - mask + root) % p)
            return
        if vrank + mask < p:
            t.recv(incoming, (vrank + mask + root) % p)
            op(buf, incoming, out=buf)
        mask <<= 1


def broadcast(t: Transport, buf, root: int = 0) -> None:
    """Binomial broadcast of ``buf`` from ``root`` (MPICH's scheme over root-relative ranks)."""
    p = t.size
    vrank = (t.rank - root) % p
    mask = 1
    while mask < p:
        if vrank & mask:
            t.recv(buf, (vrank - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vrank + mask < p:
            t.send(buf, (vrank + mask + root) % p)
        mask >>= 1


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    reduce(t, buf, op, root=0)
    if t.rank == 0:
        op.finish(buf)
    broadcast(t, buf, root=0)
