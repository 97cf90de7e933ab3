"""Recursive halving / doubling (Rabenseifner; Thakur, Rabenseifner & Gropp 2005).

Reduce-scatter by recursive halving (log2 p rounds, halving the exchanged data each round), then
all-gather by recursive doubling. For p not a power of two the standard fold-in is used: of the first
2*rem ranks (rem = p - 2^floor(log2 p)), each even rank hands its data to the odd rank above it and
sits out; the 2^k remaining ranks run the power-of-two algorithm on "blocks" that cover the chunks of
both partners; at the end the odd ranks hand the result back.

Two ranks all-reduce a small vector by recursive doubling's one round instead (:func:`exchange`): the whole
vector each way, one message where halving and doubling send two; on host arrays in one C call (:func:`express`).
"""
from __future__ import annotations

from array import array
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..buffers import ReduceOp
from ..errors import MpcommError
from ..kernels import combine
from ..native_calls import load as load_calls
from ..transport import Transport
from . import native
from .chunks import chunk_bounds, equal_bounds

# At p = 2 up to this many bytes the all-reduce is one exchange; its C call holds the GIL, as native's one call does
# up to the same size
EXCHANGE_UPTO = 64 << 10


class _Fold:
    """The power-of-two sub-group: this rank's index in it (None if folded away) and the rank map."""

    def __init__(self, p: int, rank: int):
        self.p2 = 1 << (p.bit_length() - 1)
        self.rem = p - self.p2
        if rank < 2 * self.rem:
            self.vrank = rank // 2 if rank % 2 else None
        else:
            self.vrank = rank - self.rem

    @property
    def index(self) -> int:
        """This rank's virtual rank; only for a rank that takes part in the power-of-two group."""
        assert self.vrank is not None, "a folded-away rank has no virtual rank"
        return self.vrank

    def virtual(self, rank: int) -> int:
        """The virtual rank that stands for ``rank`` (its partner's, if ``rank`` was folded away)."""
        if rank < 2 * self.rem:
            return rank // 2
        return rank - self.rem

    def real(self, vrank: int) -> int:
        return 2 * vrank + 1 if vrank < self.rem else vrank + self.rem

    def chunks_of(self, vrank: int) -> range:
        """Which of the p original chunks virtual rank ``vrank`` is responsible for."""
        first = 2 * vrank if vrank < self.rem else vrank + self.rem
        return range(first, first + (2 if vrank < self.rem else 1))

    def blocks(self, bounds) -> list[tuple[int, int]]:
        """Element range of each virtual rank's block, from the p original chunk bounds."""
        return [(bounds[c[0]][0], bounds[c[-1]][1]) for c in map(self.chunks_of, range(self.p2))]


def _span(blocks, lo: int, hi: int) -> slice:
    return slice(blocks[lo][0], blocks[hi - 1][1])


def halving_reduce_scatter(t: Transport, fold: _Fold, buf, op: ReduceOp, blocks, finish: bool = False,
                           src=None) -> None:
    """On the virtual group: afterwards ``buf[blocks[vrank]]`` holds its fully reduced block (``finish``: finished
    by the last round's reduction, as the ring's last step does: avg's division in the same pass). The first round
    reads this rank's vector from ``src`` (default ``buf``: in place), so an input that must stay as it is needs
    no copy first."""
    src = buf if src is None else src
    vrank, lo, hi = fold.index, 0, fold.p2
    incoming = t.scratch("rhd.recv", buf.size, buf.dtype, like=buf)
    mask = fold.p2 // 2
    while mask:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not vrank & mask else ((mid, hi), (lo, mid))
        kept = buf[_span(blocks, *keep)]
        received = incoming[: kept.size]
        t.sendrecv(src[_span(blocks, *give)], fold.real(vrank ^ mask), received, fold.real(vrank ^ mask))
        combine(src[_span(blocks, *keep)], received, kept, op, finish and mask == 1)
        src, lo, hi = buf, *keep
        mask //= 2
    if src is not buf:  # (no round: one rank)
        buf[...] = src
    if finish and fold.p2 == 1:  # (no round to finish in)
        op.finish(buf[_span(blocks, lo, hi)])


def doubling_all_gather(t: Transport, fold: _Fold, buf, blocks) -> None:
    """In place on the virtual group: each holds ``buf[blocks[vrank]]``; afterwards all hold every block."""
    vrank = fold.index
    lo, hi = vrank, vrank + 1
    mask = 1
    while mask < fold.p2:
        partner = fold.real(vrank ^ mask)
        other = (lo - mask, lo) if vrank & mask else (hi, hi + mask)
        t.sendrecv(buf[_span(blocks, lo, hi)], partner, buf[_span(blocks, *other)], partner)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        mask <<= 1


def fold_and_halve(t: Transport, fold: _Fold, buf, op: ReduceOp, blocks, finish: bool = False, src=None) -> None:
    """The odd rank of a folded pair adds its partner's vector in, then the virtual group reduce-scatters by
    recursive halving: afterwards ``buf[blocks[vrank]]`` is fully reduced (and finished, with ``finish``). This
    rank's vector is read from ``src`` (default ``buf``), as :func:`halving_reduce_scatter` does."""
    src = buf if src is None else src
    if t.rank < 2 * fold.rem:
        incoming = t.scratch("rhd.fold", buf.size, buf.dtype, like=buf)
        t.recv(incoming, t.rank - 1)
        combine(src, incoming, buf, op)
        src = buf
    halving_reduce_scatter(t, fold, buf, op, blocks, finish, src)


def binomial_gather_blocks(t: Transport, fold: _Fold, buf, blocks, vroot: int) -> None:
    """In place on the virtual group: each holds ``buf[blocks[vrank]]``; afterwards ``vroot`` holds every block.

    A binomial tree over ``vrank ^ vroot``: in round ``mask`` a rank whose relative index has that bit set
    sends the aligned range of ``mask`` blocks it has gathered to ``vrank ^ mask`` and stops.
    """
    vrank, mask = fold.index, 1
    while mask < fold.p2:
        partner = vrank ^ mask
        if (vrank ^ vroot) & mask:
            lo = vrank & ~(mask - 1)
            t.send(buf[_span(blocks, lo, lo + mask)], fold.real(partner))
            return
        lo = partner & ~(mask - 1)
        t.recv(buf[_span(blocks, lo, lo + mask)], fold.real(partner))
        mask <<= 1


def reduce(t: Transport, sendbuf, recvbuf, op: ReduceOp, root: int = 0) -> None:
    """Rabenseifner's reduce: recursive-halving reduce-scatter, then a binomial gather of the reduced blocks
    to ``root`` (``recvbuf`` may be None elsewhere). Moves 2(p-1)/p of the vector per rank instead of the
    tree's log p whole vectors, so it wins for large messages."""
    fold = _Fold(t.size, t.rank)
    vroot = fold.virtual(root)
    if fold.vrank is None:  # even rank of a folded pair: hand the data over (and, as root, get the result)
        t.send(sendbuf, t.rank + 1)
        if t.rank == root:
            t.recv(recvbuf, t.rank + 1)
        return
    work = t.scratch("rhd.work", sendbuf.size, sendbuf.dtype, like=sendbuf)
    blocks = chunk_bounds(work.size, fold.p2)
    fold_and_halve(t, fold, work, op, blocks, finish=True, src=sendbuf)
    binomial_gather_blocks(t, fold, work, blocks, vroot)
    if fold.vrank == vroot:
        if t.rank == root:
            recvbuf[...] = work
        else:
            t.send(work, root)


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    if t.size == 2 and buf.nbytes <= EXCHANGE_UPTO:
        exchange(t, buf, op)
        return
    fold = _Fold(t.size, t.rank)
    if fold.vrank is None:  # even rank of a folded pair: hand the data over, get the result back
        t.send(buf, t.rank + 1)
        t.recv(buf, t.rank + 1)
        return
    blocks = chunk_bounds(buf.size, fold.p2)
    fold_and_halve(t, fold, buf, op, blocks, finish=True)
    doubling_all_gather(t, fold, buf, blocks)
    if t.rank < 2 * fold.rem:
        t.send(buf, t.rank - 1)


def reduce_scatter(t: Transport, sendbuf, recvbuf, op: ReduceOp) -> None:
    fold = _Fold(t.size, t.rank)
    bounds = equal_bounds(recvbuf.size, t.size)
    if fold.vrank is None:
        t.send(sendbuf, t.rank + 1)
        t.recv(recvbuf, t.rank + 1)
        op.finish(recvbuf)
        return
    work = t.scratch("rhd.work", sendbuf.size, sendbuf.dtype, like=sendbuf)
    fold_and_halve(t, fold, work, op, fold.blocks(bounds), src=sendbuf)
    if t.rank < 2 * fold.rem:
        t.send(work[slice(*bounds[t.rank - 1])], t.rank - 1)
    recvbuf[...] = work[slice(*bounds[t.rank])]
    op.finish(recvbuf)


def all_gather(t: Transport, sendbuf, recvbuf) -> None:
    fold = _Fold(t.size, t.rank)
    bounds = equal_bounds(sendbuf.size, t.size)
    if fold.vrank is None:
        t.send(sendbuf, t.rank + 1)
        t.recv(recvbuf, t.rank + 1)
        return
    recvbuf[slice(*bounds[t.rank])] = sendbuf
    if t.rank < 2 * fold.rem:
        t.recv(recvbuf[slice(*bounds[t.rank - 1])], t.rank - 1)
    doubling_all_gather(t, fold, recvbuf, fold.blocks(bounds))
    if t.rank < 2 * fold.rem:
        t.send(recvbuf, t.rank - 1)


def exchange(t: Transport, buf, op: ReduceOp) -> None:
    """Two ranks: the whole vector sent each way, then rank 0's op rank 1's on both, so both hold the same bits.
    What :func:`express`'s C call takes is reduced and finished as it does (``native_calls.exchanged``), so a rank
    whose buffer that call does not take (or whose plan is new) pairs with it here; the rest as the algorithms
    reduce (``combine``)."""
    peer, nbytes = 1 - t.rank, buf.nbytes
    reduction = native.one_call(t, buf, op) if buf.flags.c_contiguous and buf.flags.writeable else None
    if reduction is None:
        incoming = t.scratch("rhd.recv", buf.size, buf.dtype, like=buf)
        t.sendrecv(buf, peer, incoming, peer)
        combine(*((buf, incoming) if t.rank == 0 else (incoming, buf)), buf, op, True)
        return
    own = _exchange_buffer(t, nbytes)
    own[:nbytes].view(buf.dtype)[...] = buf.reshape(-1)
    t.sendrecv(own[:nbytes], peer, own[nbytes:], peer)
    mpi_op, finish = reduction
    load_calls().exchanged((t.fortran, mpi_op.py2f(), finish, 0, own), buf)


def _exchange_buffer(t: Transport, nbytes: int):
    """This rank's vector as sent and the other's as received, ``nbytes`` each: in ``t``'s one buffer for every
    exchange, the C call's and Python's (they run one at a time), made at its largest at once."""
    return t.scratch("rhd.exchange", 2 * EXCHANGE_UPTO, np.uint8)[: 2 * nbytes]


def express(t: Transport, buf, op: ReduceOp, totals: array, nbytes: int) -> Callable[[Any], Any] | None:
    """:func:`exchange` of host arrays of ``buf``'s count, dtype and op on ``t`` as one C call
    (``native_calls.ExpressCall``), reducing with the MPI op and finish of native's one call
    (:func:`native.one_call`); it holds ``t.in_use`` and counts ``nbytes`` into ``totals`` as native's
    :func:`native.express`.
    Called on an array: None once done, NotImplemented (nothing sent) for an array it does not take, else what is
    left for :func:`complete`. None where there is no such call (p != 2, more than ``EXCHANGE_UPTO`` bytes)."""
    reduction = native.one_call(t, buf, op) if t.size == 2 and buf.nbytes <= EXCHANGE_UPTO else None
    if reduction is None:
        return None
    mpi_op, finish = reduction
    bound = (t.fortran, mpi_op.py2f(), finish, native.c_tests(t), _exchange_buffer(t, buf.nbytes))
    return load_calls().ExpressCall(bound, t.in_use, totals, float(nbytes))


def complete(t: Transport, buf, op: ReduceOp, outcome) -> None:
    """The rest of an exchange whose express call returned ``outcome``: its requests waited for within the deadline,
    then reduced and finished in C (``native_calls.exchanged``); a message of another size is an error."""
    peer = 1 - t.rank
    if type(outcome) is int:
        raise MpcommError(f"rank {t.rank}: {t.operation}: received {outcome} bytes from rank {peer}, expected "
                          f"{buf.nbytes} (do all ranks pass the same sizes and dtypes?)")
    receiving, sending, bound = outcome
    t.wait([MPI.Request.f2py(receiving), MPI.Request.f2py(sending)], (peer, peer), (buf.nbytes, None))
    load_calls().exchanged(bound, buf)
