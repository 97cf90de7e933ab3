"""native's all-reduce for every float op against the MPI library's own op, in one job.

For each dtype and size this times, interleaved round-robin: raw mpi4py ``Allreduce`` with MPI's SUM, MAX, MIN and
PROD (no deadline and none of mpcomm's NaN or signed-zero rules: the reference), and ``comm.allreduce(...,
algorithm="native")`` with sum, max, min, avg and prod. Each row gives the median loop of the slowest rank, min-max
of the rounds as the spread, its ratio to raw ``Allreduce`` with the same op (avg: SUM), and to native's sum of the
same dtype and size (what issue 27 asks of the other ops).

    timeout 900 mpiexec -n 2 python bench/native_ops.py --dtype float32,float64 --sizes 32768,262144,2097152
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


def contenders(comm: Communicator, buf: np.ndarray) -> dict:
    """raw and native calls on ``buf`` (ones: repeated sums, products and extremes stay finite and exact)."""
    world = comm.mpi
    calls = {f"raw {name}": (lambda op: lambda: world.Allreduce(MPI.IN_PLACE, buf, op))(op)
             for name, op in RAW_OPS.items()}
    for op in OPS:
        calls[f"native {op}"] = (lambda op: lambda: comm.allreduce(buf, op=op, algorithm="native"))(op)
    return calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32,float64", help="comma-separated (default float32,float64)")
    sweep_arguments(parser, SIZES, calls=1000, rounds=5)
    args = parser.parse_args(argv)
    comm = Communicator(MPI.COMM_WORLD)
    rows = []
    for dtype in map(np.dtype, args.dtype.split(",")):
        for nbytes in (int(s) for s in args.sizes.split(",")):
            buf = np.ones(max(1, nbytes // dtype.itemsize), dtype)
            loop = max(5, min(args.calls, (64 << 20) // max(nbytes, 1)))  # ~64 MiB moved per loop at most
            times = measure(comm.mpi, contenders(comm, buf), loop, args.rounds)
            native_sum = float(np.median(times["native sum"]))
            for row in summarize(times, "raw sum"):
                kind, op = row["contender"].split()
                raw = float(np.median(times[f"raw {'sum' if op == 'avg' else op}"]))
                rows.append({"dtype": str(dtype), "bytes": nbytes, **row, "x_raw": row["median_us"] / raw,
                             "x_native_sum": row["median_us"] / native_sum if kind == "native" else None})
    if comm.rank == 0:
        print(f"{comm.size} ranks on {library_name()}; {args.rounds} rounds; "
              "us per call, median [min-max]; x raw: to raw Allreduce with the same op (avg: SUM); "
              "x sum: to native's sum")
        print(f"{'dtype':8} {'bytes':>9} {'contender':12} {'median':>10} {'spread':>21} {'x raw':>6} {'x sum':>6}")
        for row in rows:
            spread = f"[{row['min_us']:.2f}-{row['max_us']:.2f}]"
            to_sum = "" if row["x_native_sum"] is None else f"{row['x_native_sum']:6.2f}"
            print(f"{row['dtype']:8} {row['bytes']:9d} {row['contender']:12} {row['median_us']:10.2f} {spread:>21} "
                  f"{row['x_raw']:6.2f} {to_sum:>6}")
        write_rows(args.json, comm, args.rounds, rows)
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
