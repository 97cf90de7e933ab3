"""Whether the MPI library delivers every message that a receive from ANY_SOURCE matches, in raw mpi4py.

Every round, every rank but 0 sends rank 0 one 44-byte message under the round's tag, and rank 0 receives p - 1 of
them from ANY_SOURCE, each way below; a receive that finds nothing within ``--patience`` seconds counts as lost
(then cancelled). Between nodes MPICH over UCX lost messages that a posted receive (``irecv``) matched, and none
that a probe found (docs/mpi.md). On the simulated cluster:

    ci/cluster.sh 4 1 1gbit -- mpiexec -n 4 .venv/bin/python bench/experiments/any_source.py --way irecv
    ci/cluster.sh 4 1 1gbit -- mpiexec -n 4 .venv/bin/python bench/experiments/any_source.py --way improbe

Rank 0 prints the rounds that lost messages and the total lost.
"""
from __future__ import annotations

import argparse
import time

from mpi4py import MPI


def receive(comm: MPI.Comm, way: str, tag: int, patience: float) -> int | None:
    """One message under ``tag`` from any rank, received ``way``: its source, or None if none came in time."""
    buf, status, start = bytearray(64), MPI.Status(), time.monotonic()
    if way == "irecv":
        request = comm.Irecv(buf, MPI.ANY_SOURCE, tag)
        while not request.Test(status):
            if time.monotonic() - start > patience:
                request.Cancel()
                request.Wait()
                return None
        return status.Get_source()
    while time.monotonic() - start < patience:
        message = comm.Improbe(MPI.ANY_SOURCE, tag, status)
        if message is not None:
            message.Recv(buf)
            return status.Get_source()
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--way", choices=["irecv", "improbe"], required=True)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--patience", type=float, default=5.0, help="seconds a receive waits before it counts lost")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm, rank, size = world.Dup(), world.Get_rank(), world.Get_size()
    lost = 0
    for tag in range(args.rounds):
        if rank == 0:
            sources = [receive(comm, args.way, tag, args.patience) for _ in range(size - 1)]
            if None in sources:
                lost += sources.count(None)
                print(f"round {tag}: received from {sorted(s for s in sources if s is not None)} only", flush=True)
        else:
            comm.Send(bytes([rank]) * 44, 0, tag)
        world.Barrier()
    if rank == 0:
        print(f"{MPI.Get_library_version().splitlines()[0].strip()}, {args.way}: {args.rounds} rounds of {size - 1} "
              f"messages, {lost} lost", flush=True)
    comm.Free()


if __name__ == "__main__":
    main()
