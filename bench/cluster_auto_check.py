"""Is auto's choice right on this cluster? Every all-reduce algorithm timed call by call, interleaved, many times.

    ci/cluster.sh 2 2 1gbit -- mpiexec -n 4 python bench/cluster_auto_check.py --reps 30 --out check_2x2.md
    mpiexec -n 4 python bench/cluster_auto_check.py --sizes 8,2048,32K,2M,64M    # one host works too
    ... bench/cluster_auto_check.py --dtype bfloat16 --op sum                    # any dtype and op (default float32 sum)

mpcomm-bench times blocks of calls per algorithm; on a machine other jobs are loading, one slow block moves a
whole row, and "auto" timed separately from the algorithm it runs adds a second sample of the same noise. Here
every repetition runs each algorithm once, in a rotating order, with a barrier before each call, and the time of
a call is the slowest rank's; per algorithm the minimum (what the link and the algorithm allow when nothing
else gets in the way) and the median over the repetitions are reported. auto's choice (``comm.selector``, no
tune()) is then judged by the time of the algorithm it chose against the best, by minimum and by median.
Also printed: the network the communicator measured when it was created.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms import ALLREDUCE
from mpcomm.bench.cli import DTYPES, REDOPS
from mpcomm.bench.report import human_bytes


def sizes(text: str) -> list[int]:
    units = {"K": 1 << 10, "M": 1 << 20}
    return [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=sizes, default=sizes("64K,256K,1M,4M,16M,64M"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="write the markdown table here (rank 0)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--op", choices=REDOPS, default="sum")
    args = parser.parse_args()
    comm = Communicator(MPI.COMM_WORLD)
    algorithms = list(ALLREDUCE)
    dtype, op = np.dtype(DTYPES[args.dtype]), args.op
    lines = [f"all-reduce of {dtype} {op}, {comm.size} ranks on {comm.num_nodes} nodes of {comm.node_size}; "
             f"{comm.selector.network or 'one host: no network measured'}; "
             f"{args.reps} interleaved calls per algorithm and size, time of the slowest rank, in ms "
             "(min / median)", "",
             "| size | " + " | ".join(algorithms) + " | auto chose | best (min) | chosen / best, min | "
             "best (median) | chosen / best, median |",
             "|---:|" + "---:|" * len(algorithms) + "---|---|---:|---|---:|"]
    for nbytes in args.sizes:
        buf = np.zeros(nbytes // dtype.itemsize, dtype)  # in-place reductions of zeros never overflow
        for algorithm in algorithms:
            comm.allreduce(buf, op, algorithm=algorithm)  # warm-up
        times: dict[str, list[float]] = {a: [] for a in algorithms}
        for rep in range(args.reps):
            for algorithm in algorithms[rep % len(algorithms):] + algorithms[:rep % len(algorithms)]:
                comm.barrier()
                start = time.perf_counter()
                comm.allreduce(buf, op, algorithm=algorithm)
                times[algorithm].append(time.perf_counter() - start)
        slowest = {a: np.max(comm.mpi.allgather(np.array(t)), axis=0) * 1e3 for a, t in times.items()}
        low = {a: float(t.min()) for a, t in slowest.items()}
        mid = {a: float(np.median(t)) for a, t in slowest.items()}
        chosen = comm.selector.choose("allreduce", nbytes, dtype, op)
        best_low, best_mid = min(low, key=low.get), min(mid, key=mid.get)
        lines.append(f"| {human_bytes(nbytes)} | " + " | ".join(f"{low[a]:.2f} / {mid[a]:.2f}" for a in algorithms) +
                     f" | {chosen} | {best_low} | {low[chosen] / low[best_low]:.2f} | {best_mid} | "
                     f"{mid[chosen] / mid[best_mid]:.2f} |")
        if comm.rank == 0:
            print(lines[-1], flush=True)
    if comm.rank == 0:
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
