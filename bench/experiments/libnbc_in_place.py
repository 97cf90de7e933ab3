"""What Open MPI's non-blocking all-reduce costs in place, from a separate input, and under each of libnbc's
algorithms, beside its blocking call and mpcomm's algorithms (issue 32: native polls it across nodes and where ranks
share cores).

libnbc (``ompi/mca/coll/libnbc/nbc_iallreduce.c``) runs every in-place ``MPI_Iallreduce`` as a binomial reduce and
broadcast; from a separate input it picks Rabenseifner's from 4 ranks and 64 KiB. Its MCA variable
``coll_libnbc_iallreduce_algorithm`` (0 its own choice, 1 ring, 2 binomial, 3 Rabenseifner, 4 recursive doubling)
is switched here through MPI_T (ctypes on the library mpi4py loaded), on every rank alike between loops:

    mpiexec -n P python bench/experiments/libnbc_in_place.py [--sizes 16384,65536,...] [--rounds 5]

(Open MPI only.) Interleaved round-robin after a barrier; a loop's time is the slowest rank's; prints the median
loop per call and its ratio to the blocking call, with the rounds' min-max.
"""
from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.mpi_library import loaded_path

ALGORITHMS = {1: "ring", 3: "Rabenseifner", 4: "recursive doubling"}
MPCOMM = ("native", "hierarchical", "ring", "rhd", "ring_pipelined", "auto")


class LibnbcAlgorithm:
    """libnbc's ``coll_libnbc_iallreduce_algorithm``, read and written through MPI_T."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(loaded_path())
        provided, index = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.MPI_T_init_thread(0, ctypes.byref(provided)), "MPI_T_init_thread")
        self._check(self.lib.MPI_T_cvar_get_index(b"coll_libnbc_iallreduce_algorithm", ctypes.byref(index)),
                    "MPI_T_cvar_get_index (is this Open MPI?)")
        self.handle, count = ctypes.c_void_p(), ctypes.c_int()
        self._check(self.lib.MPI_T_cvar_handle_alloc(index, None, ctypes.byref(self.handle), ctypes.byref(count)),
                    "MPI_T_cvar_handle_alloc")

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise SystemExit(f"{call} returned {code}")

    def set(self, value: int) -> None:
        self._check(self.lib.MPI_T_cvar_write(self.handle, ctypes.byref(ctypes.c_int(value))), "MPI_T_cvar_write")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16384,65536,262144,1048576,4194304")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    world, algorithm = MPI.COMM_WORLD, LibnbcAlgorithm()
    comm = Communicator(world)

    def loop(call, n: int) -> float:
        world.Barrier()
        start = time.perf_counter()
        for _ in range(n):
            call()
        return world.allreduce((time.perf_counter() - start) / n * 1e6, op=MPI.MAX)

    def polled(request) -> None:
        while not request.Test():
            pass

    def under(value: int, call):
        def run() -> None:
            algorithm.set(value)
            call()
            algorithm.set(0)
        return run

    for nbytes in map(int, args.sizes.split(",")):
        buf, source = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
        in_place = lambda: polled(world.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM))  # noqa: E731
        calls = {"raw Allreduce (blocking)": lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
                 "Iallreduce in place": in_place,
                 "Iallreduce from another buffer": lambda: polled(world.Iallreduce(source, buf, MPI.SUM))}
        calls.update({f"Iallreduce in place, {name}": under(value, in_place) for value, name in ALGORITHMS.items()})
        calls.update({f"mpcomm {name}": (lambda name: lambda: comm.allreduce(buf, algorithm=name))(name)
                      for name in MPCOMM})
        n = max(3, min(2000, 20_000_000 // nbytes))
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                times[name].append(loop(call, n))
        if world.rank == 0:
            raw = float(np.median(times["raw Allreduce (blocking)"]))
            print(f"{nbytes} bytes, {world.size} ranks, {n} calls per loop, {args.rounds} rounds; us per call")
            for name, values in times.items():
                median = float(np.median(values))
                print(f"  {name:36s} {median:10.1f}  x {median / raw:4.2f}  [{min(values):.1f}-{max(values):.1f}]",
                      flush=True)
    comm.free()


if __name__ == "__main__":
    main()
