"""Binomial-tree algorithms: reduce, broadcast, gather and scatter, each in ceil(log2 p) rounds.

All-reduce = reduce to rank 0 + broadcast: latency-optimal for small messages (2 log p messages on the
critical path) but every round moves the whole vector, so it loses to ring/rhd on large ones. Gather and
scatter move (p-1)/p of the data through the root's links in log p rounds, the textbook choice for all sizes.
"""
from __future__ import annotations

from ..buffers import ReduceOp
from ..kernels import combine
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
            combine(buf, incoming, buf, op)
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


def reduce_to(t: Transport, sendbuf, recvbuf, op: ReduceOp, root: int = 0) -> None:
    """``recvbuf`` on ``root`` <- the reduction of every rank's ``sendbuf`` (``recvbuf`` may be None elsewhere):
    :func:`reduce` on a copy, so ``sendbuf`` is left as it was."""
    work = recvbuf if t.rank == root else t.scratch("tree.work", sendbuf.size, sendbuf.dtype, like=sendbuf)
    work[...] = sendbuf
    reduce(t, work, op, root)
    if t.rank == root:
        op.finish(work)


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    reduce(t, buf, op, root=0)
    if t.rank == 0:
        op.finish(buf)
    broadcast(t, buf, root=0)


def gather(t: Transport, sendbuf, recvbuf, root: int = 0) -> None:
    """Binomial gather: ``recvbuf`` on ``root`` <- every rank's ``sendbuf`` in rank order (``recvbuf`` may be
    None elsewhere). Subtrees hold consecutive root-relative ranks, so each round forwards one contiguous range;
    the root rotates the relative order back to rank order at the end."""
    p, n = t.size, sendbuf.size
    vrank = (t.rank - root) % p
    held = t.scratch("tree.gather", p * n, sendbuf.dtype, like=sendbuf)  # blocks in root-relative rank order
    held[:n] = sendbuf
    count, mask = 1, 1  # blocks held: vrank .. vrank + count - 1
    while mask < p:
        if vrank & mask:
            t.send(held[: count * n], (vrank - mask + root) % p)
            return
        if vrank + mask < p:
            incoming = min(mask, p - vrank - mask)
            t.recv(held[count * n : (count + incoming) * n], (vrank + mask + root) % p)
            count += incoming
        mask <<= 1
    recvbuf[root * n :] = held[: (p - root) * n]
    recvbuf[: root * n] = held[(p - root) * n : p * n]


def scatter(t: Transport, sendbuf, recvbuf, root: int = 0) -> None:
    """Binomial scatter: ``recvbuf`` <- block ``rank`` of ``sendbuf`` on ``root`` (``sendbuf`` may be None
    elsewhere). The mirror of :func:`gather`: each rank receives its subtree's blocks, keeps its own, and
    forwards the rest, largest subtree first."""
    p, n = t.size, recvbuf.size
    vrank = (t.rank - root) % p
    held = t.scratch("tree.scatter", p * n, recvbuf.dtype, like=recvbuf)  # root-relative order
    mask = 1
    if vrank == 0:
        held[: (p - root) * n] = sendbuf[root * n :]
        held[(p - root) * n : p * n] = sendbuf[: root * n]
        while mask < p:
            mask <<= 1
    else:
        while not vrank & mask:
            mask <<= 1
        t.recv(held[: min(mask, p - vrank) * n], (vrank - mask + root) % p)
    mask >>= 1
    while mask > 0:
        if vrank + mask < p:
            t.send(held[mask * n : min(2 * mask, p - vrank) * n], (vrank + mask + root) % p)
        mask >>= 1
    recvbuf[...] = held[:n]
