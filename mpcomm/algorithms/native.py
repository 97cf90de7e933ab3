"""The MPI library's own collectives, issued non-blocking so the wait is bounded by the timeout."""
from __future__ import annotations

from mpi4py import MPI

from ..buffers import ReduceOp
from ..transport import Transport


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    _wait(t, t.mpi.Iallreduce(MPI.IN_PLACE, buf, op.mpi))
    op.finish(buf)


def reduce_scatter(t: Transport, sendbuf, recvbuf, op: ReduceOp) -> None:
    _wait(t, t.mpi.Ireduce_scatter_block(sendbuf, recvbuf, op.mpi))


def all_gather(t: Transport, sendbuf, recvbuf) -> None:
    _wait(t, t.mpi.Iallgather(t._wire(sendbuf), t._wire(recvbuf)))


def broadcast(t: Transport, buf, root: int = 0) -> None:
    _wait(t, t.mpi.Ibcast(t._wire(buf), root))


def _wait(t: Transport, request: MPI.Request) -> None:
    t.wait([request], peers=t.others)
