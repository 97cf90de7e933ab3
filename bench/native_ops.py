"""native's (or another algorithm's) all-reduce for every float op against the MPI library's own op, in one job.

For each dtype and size this times, interleaved round-robin: raw mpi4py ``Allreduce`` with MPI's SUM, MAX, MIN and
PROD (no deadline and none of mpcomm's NaN or signed-zero rules: the reference), and ``comm.allreduce(...,
algorithm=ALGORITHM)`` (default native; ``auto``: what a user's call runs) with sum, max, min, avg and prod. Each
row gives the median loop of the slowest rank, min-max of the rounds as the spread, its ratio to raw ``Allreduce``
with the same op (avg: SUM), and to the algorithm's sum of the same dtype and size (what issue 27 asks of the other
ops).

    timeout 900 mpiexec -n 2 python bench/native_ops.py --dtype float32,float64 --sizes 32768,262144,2097152
    timeout 900 mpiexec -n 2 python bench/native_ops.py --algorithm auto
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI
from small_messages import library_name, measure, summarize, sweep_arguments, write_rows

from mpcomm import Communicator

RAW_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
OPS = ("sum", "max", "min", "avg", "prod")
SIZES = "8,4096,32768,262144,2097152,16777216"


def contenders(comm: Communicator, buf: np.ndarray, algorithm: str) -> dict:
    """raw calls and ``algorithm``'s on ``buf`` (ones: products and extremes stay exact; repeated sums double,
    to inf in float32 after 128 calls, which costs the adds nothing)."""
    world = comm.mpi
    calls = {f"raw {name}": (lambda op: lambda: world.Allreduce(MPI.IN_PLACE, buf, op))(op)
             for name, op in RAW_OPS.items()}
    for op in OPS:
        calls[f"{algorithm} {op}"] = (lambda op: lambda: comm.allreduce(buf, op=op, algorithm=algorithm))(op)
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,float64", help="comma-separated (default float32,float64)")
    parser.add_argument("--algorithm", default="native", help="mpcomm's algorithm timed per op (default native)")
    sweep_arguments(parser, SIZES, calls=1000, rounds=5)
    args = parser.parse_args(argv)
    comm = Communicator(MPI.COMM_WORLD)
    rows = []
    for dtype in map(np.dtype, args.dtype.split(",")):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            buf = np.ones(max(1, nbytes // dtype.itemsize), dtype)
            loop = max(5, min(args.calls, (64 << 20) // max(nbytes, 1)))  # ~64 MiB moved per loop at most
            times = measure(comm.mpi, contenders(comm, buf, args.algorithm), loop, args.rounds)
            own_sum = float(np.median(times[f"{args.algorithm} sum"]))
            for row in summarize(times, "raw sum"):
                kind, op = row["contender"].split()
                raw = float(np.median(times[f"raw {'sum' if op == 'avg' else op}"]))
                rows.append({"dtype": str(dtype), "bytes": nbytes, **row, "x_raw": row["median_us"] / raw,
                             "x_sum": row["median_us"] / own_sum if kind == args.algorithm else None})
    if comm.rank == 0:
        print(f"{comm.size} ranks on {library_name()}; {args.rounds} rounds; "
              "us per call, median [min-max]; x raw: to raw Allreduce with the same op (avg: SUM); "
              f"x sum: to {args.algorithm}'s sum")
        print(f"{'dtype':8} {'bytes':>9} {'contender':12} {'median':>10} {'spread':>21} {'x raw':>6} {'x sum':>6}")
        for row in rows:
            spread = f"[{row['min_us']:.2f}-{row['max_us']:.2f}]"
            to_sum = "" if row["x_sum"] is None else f"{row['x_sum']:6.2f}"
            print(f"{row['dtype']:8} {row['bytes']:9d} {row['contender']:12} {row['median_us']:10.2f} {spread:>21} "
                  f"{row['x_raw']:6.2f} {to_sum:>6}")
        write_rows(args.json, comm, args.rounds, rows)
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
