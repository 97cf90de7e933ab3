"""What the deadline costs the MPI library's own all-reduce, per way of waiting for it, measured in one job.

``mpiexec -n P python bench/native_wait.py [--sizes 8,64,...] [--calls 2000] [--rounds 7] [--json FILE]``

mpcomm bounds every wait, so ``native`` cannot make the blocking MPI call as it is; ``mpcomm.mpi_library`` says
how it waits on each library. For each size (float32 sum) this times, interleaved round-robin: raw mpi4py
``Allreduce`` (no deadline: the reference), raw ``Iallreduce`` + ``Test`` loop and a raw persistent request
(``Allreduce_init``, started per call over its own buffer, with the copies in and out) — what each way costs in
MPI alone — then ``native`` forced to each of its ways (``[nonblocking]``, ``[persistent]``,
``[meet+blocking]``), ``native`` as this library's profile chooses (through ``native_calls``' C calls where they
are built: the plan's express call up to 64 KiB where the way is the one C call; and through mpi4py's calls), and
mpcomm's rhd and ring; each ``native`` on a Communicator of its own, whose plans are made under its way. A loop's
time is the slowest rank's; reports the median loop, min-max as the spread, and each contender's ratio to raw
``Allreduce`` of the same size in the same run.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI
from small_messages import library_name, measure, print_rows, summarize, sweep_arguments, write_rows

from mpcomm import Communicator
from mpcomm.algorithms import native
from mpcomm.mpi_library import WAYS, forced, library
from mpcomm.native_calls import load as load_calls

SIZES = "8,64,512,4096,32768,262144,2097152,16777216"


def contenders(comm: Communicator, buf: np.ndarray, comms: list) -> tuple[dict, MPI.Prequest]:
    """The calls timed on ``buf``, by name, and the raw persistent request (freed by the caller, with the
    Communicators each native contender gets, appended to ``comms``)."""
    world = comm.mpi
    own = np.empty_like(buf)
    persistent = world.Allreduce_init(MPI.IN_PLACE, own, MPI.SUM)

    def poll(request):
        while not request.Test():
            pass

    def raw_persistent():
        own[...] = buf
        persistent.Start()
        poll(persistent)
        buf[...] = own

    def native_as(profile, through=load_calls):
        own_comm = Communicator(MPI.COMM_WORLD)  # (its plans, and their express calls, made under this profile)
        comms.append(own_comm)

        def call():
            native.library = lambda: profile  # (every rank sets the same: the ways stay paired across ranks)
            native.load_calls = through
            own_comm.allreduce(buf, algorithm="native")
        return call

    shipped = library()
    calls = {
        "raw Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
        "raw Iallreduce+Test": lambda: poll(world.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)),
        "raw persistent+copies": raw_persistent,
    }
    for way in WAYS:
        calls[f"native [{way}]"] = native_as(forced(way))
    calls[f"native ({shipped.name})"] = native_as(shipped)
    calls[f"native ({shipped.name}), mpi4py"] = native_as(shipped, through=lambda: None)
    calls["mpcomm rhd"] = lambda: comm.allreduce(buf, algorithm="rhd")
    calls["mpcomm ring"] = lambda: comm.allreduce(buf, algorithm="ring")
    return calls, persistent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep_arguments(parser, SIZES, calls=2000, rounds=7)
    args = parser.parse_args(argv)
    comm = Communicator(MPI.COMM_WORLD)
    rows = []
    try:
        for nbytes in (int(s) for s in args.sizes.split(",")):
            buf = np.zeros(max(1, nbytes // 4), np.float32)  # (zeros: repeated sums stay finite)
            comms: list[Communicator] = []
            calls, persistent = contenders(comm, buf, comms)
            loop = max(5, min(args.calls, (64 << 20) // max(nbytes, 1)))  # ~64 MiB moved per loop at most
            for row in summarize(measure(comm.mpi, calls, loop, args.rounds), "raw Allreduce"):
                rows.append({"bytes": nbytes, "calls": loop, **row})
            persistent.Free()
            for own_comm in comms:
                own_comm.free()
    finally:
        native.library, native.load_calls = library, load_calls
    if comm.rank == 0:
        print_rows(f"{comm.size} ranks on {library_name()}; float32 sum; {args.rounds} rounds; us per call, median "
                   "[min-max] of the rounds, ratio to raw Allreduce", rows, "x raw")
        write_rows(args.json, comm, args.rounds, rows)
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
