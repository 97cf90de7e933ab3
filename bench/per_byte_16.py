"""Time per byte of float16/bfloat16 sums (or other dtypes') against float32's, interleaved call loop by call loop in
one job.

``mpiexec -n P python bench/per_byte_16.py [--dtype bfloat16,float16] [--sizes 1048576,...] [--calls 50]
[--rounds 9] [--native] [--json FILE]``

The issue's targets (a 16-bit sum at most 1.5x float32's time for the same bytes from 1 MiB; integers' at most 1.2x)
compare cells that ``mpcomm-bench`` times minutes apart, and this VM has slow spells of 2-4x in memory-bound loops
that a sweep's cells fall in or not. Here, for each size, the contenders are timed round-robin, a loop each in turn:
float32's ring, rhd and direct, and each ``--dtype``'s direct and auto, all on the same bytes (zeros, viewed as
each dtype: repeated sums stay zero, and no contender finds them warmer in cache than another). Reports the median
loop, min-max as the spread, and each one's ratio to float32's fastest median in the same run.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI
from small_messages import library_name, measure, print_rows, summarize, sweep_arguments, write_rows

from mpcomm import Communicator
from mpcomm.bench.cli import DTYPES

SIZES = "1048576,2097152,8388608,33554432"
FLOAT32_ALGORITHMS = ("ring", "rhd", "direct")
SIXTEEN = "bfloat16,float16"


def contenders(comm: Communicator, nbytes: int, dtypes: list[np.dtype], native: bool = False) -> dict:
    """Every contender on the same zeroed bytes, viewed as its dtype (zero in every one of them): none finds its
    buffer warmer in cache than another's (with a buffer each, the float32 ones, run back to back on theirs, read
    from cache at 8 MiB what the others read from memory). ``native``: each dtype's native too, and float32's native
    on twice the bytes, the wire a 16-bit native all-reduce widens to (what widening adds to a call)."""
    memory = np.zeros(2 * nbytes if native else nbytes, np.uint8)
    wide = memory[:nbytes].view(np.float32)
    calls = {f"float32 {a}": (lambda a=a: comm.allreduce(wide, algorithm=a)) for a in FLOAT32_ALGORITHMS}
    if native:
        calls["float32 native, 2x bytes"] = lambda: comm.allreduce(memory.view(np.float32), algorithm="native")
    for dtype in dtypes:
        short, name = memory[:nbytes].view(dtype), str(dtype)
        for algorithm in ("direct", "auto", *(("native",) if native else ())):
            calls[f"{name} {algorithm}"] = lambda short=short, algorithm=algorithm: comm.allreduce(
                short, algorithm=algorithm)
    return calls


def dtype_list(text: str) -> list[np.dtype]:
    """``--dtype``'s comma-separated names (mpcomm-bench's), as dtypes; an unknown one is argparse's error."""
    for name in text.split(","):
        if name not in DTYPES:
            raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return [np.dtype(DTYPES[name]) for name in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", type=dtype_list, default=SIXTEEN,
                        help=f"comma-separated, against float32 (default {SIXTEEN})")
    parser.add_argument("--native", action="store_true",
                        help="time each dtype's native too, and float32's native on the wire it widens to")
    sweep_arguments(parser, SIZES, calls=50, rounds=9)
    args = parser.parse_args(argv)
    comm = Communicator(MPI.COMM_WORLD)
    rows = []
    for nbytes in (int(s) for s in args.sizes.split(",")):
        loop = max(3, min(args.calls, (256 << 20) // nbytes))
        times = measure(comm.mpi, contenders(comm, nbytes, args.dtype, args.native), loop, args.rounds)
        fastest = min(FLOAT32_ALGORITHMS, key=lambda a: float(np.median(times[f"float32 {a}"])))
        for row in summarize(times, f"float32 {fastest}"):
            rows.append({"bytes": nbytes, "calls": loop, **row})
    if comm.rank == 0:
        print_rows(f"{comm.size} ranks on {library_name()}; sums; {args.rounds} rounds; us per call, median "
                   "[min-max] of the rounds, ratio to float32's fastest", rows, "x f32")
        write_rows(args.json, comm, args.rounds, rows)
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
