"""Is auto's choice right on this cluster? Every all-reduce algorithm timed call by call, interleaved, many times.

    ci/cluster.sh 2 2 1gbit -- mpiexec -n 4 python bench/cluster_auto_check.py --reps 30 --out check_2x2.md
    mpiexec -n 4 python bench/cluster_auto_check.py --sizes 8,2048,32K,2M,64M    # one host works too
    ... bench/cluster_auto_check.py --dtype bfloat16 --op sum           # any dtype and op (default: float32 sum)
    ... bench/cluster_auto_check.py --dtype float32,int8 --op all       # a matrix, one table per (dtype, op)
    ... bench/cluster_auto_check.py --algorithms ring,direct            # these alone

mpcomm-bench times blocks of calls per algorithm; on a machine other jobs are loading, one slow block moves a
whole row, and "auto" timed separately from the algorithm it runs adds a second sample of the same noise. Here
every repetition runs each algorithm once, in an order drawn afresh for each repetition (the same on every rank),
with a barrier before each call, and the time of a call is the slowest rank's; per algorithm the minimum (what the
link and the algorithm allow when nothing else gets in the way) and the median over the repetitions are reported.
auto's choice (``comm.selector``, no tune()) is then judged by the time of the algorithm it chose against the best,
by minimum and by median.
Also printed: the network the communicator measured when it was created, and, after the tables, every cell whose
choice is above ``TARGET`` of the best by median (issue 27's bound), over the (dtype, op) pairs the contract takes.
Beside each median ratio, its 95 % interval over the repetitions resampled (the best picked again in each
resample, so a lucky algorithm's lead is not taken as given): a cell whose whole interval lies above ``TARGET``
is a miss these repetitions show beyond their spread, and those are listed apart.
``--json`` writes every algorithm's median as mpcomm-bench's rows (``time_us``; ``min_us`` and the repetitions'
times, ``times_us``, beside it), so that ``bench/model_picks.py`` judges the model on interleaved runs as on sweeps.
Why the order is drawn: a call pays for what the call before it left behind, and in a fixed rotation every
algorithm has the same predecessor each time (with MPICH at p = 2, 512 KiB-1 MiB, whichever ran right after native
took about 1.1x the time of the same exchanges run after another). ``--rotate`` runs the rotation of the runs
recorded before Stop 55.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms import ALLREDUCE
from mpcomm.bench.cli import DTYPES, REDOPS, parse_size
from mpcomm.bench.report import human_bytes, write_json
from mpcomm.buffers import check_dtype_op

TARGET = 1.10


def sizes(text: str) -> list[int]:
    """A comma list of mpcomm-bench's sizes ('8', '64K', '2M', ...), in bytes."""
    return [parse_size(size) for size in text.split(",")]


def choices(allowed) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of ``allowed`` names, or "all"."""
    def parse(text: str) -> list[str]:
        names = list(allowed) if text == "all" else text.split(",")
        wrong = [name for name in names if name not in allowed]
        if wrong:
            raise argparse.ArgumentTypeError(f"{', '.join(wrong)}: not one of {', '.join(allowed)}")
        return names
    return parse


def orders(algorithms: list[str], reps: int, rotate: bool = False) -> list[list[str]]:
    """The order of the calls in each repetition: a permutation drawn from a fixed seed (so every rank draws the
    same), or with ``rotate`` the list rotated by one more place each time (each algorithm after the same one)."""
    if rotate:
        return [algorithms[rep % len(algorithms):] + algorithms[:rep % len(algorithms)] for rep in range(reps)]
    rng = np.random.default_rng(55)
    return [[algorithms[i] for i in rng.permutation(len(algorithms))] for _ in range(reps)]


def interleaved(comm: Communicator, algorithms: list[str], buf: np.ndarray, op: str, reps: int,
                rotate: bool = False) -> dict:
    """{algorithm: the slowest rank's time of each of ``reps`` calls, in us}, every algorithm once per repetition
    in the order ``orders`` gives, a barrier before each call."""
    for algorithm in algorithms * 3:  # warm-up: the plan made, and its express call (from the second call)
        comm.allreduce(buf, op, algorithm=algorithm)
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    for order in orders(algorithms, reps, rotate):
        for algorithm in order:
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce(buf, op, algorithm=algorithm)
            times[algorithm].append(time.perf_counter() - start)
    return {a: np.max(comm.mpi.allgather(np.array(t)), axis=0) * 1e6 for a, t in times.items()}


def ratio_interval(slowest: dict[str, np.ndarray], chosen: str, resamples: int = 2000,
                   seed: int = 27) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``chosen``'s median over the best algorithm's median, the repetitions
    drawn with replacement (an algorithm's times of one repetition stay together: they ran side by side) and the
    best taken again in every draw."""
    names = list(slowest)
    times = np.stack([slowest[a] for a in names])  # (algorithm, repetition)
    draws = np.random.default_rng(seed).integers(0, times.shape[1], size=(resamples, times.shape[1]))
    medians = np.median(times[:, draws], axis=2)  # (algorithm, draw)
    ratios = medians[names.index(chosen)] / medians.min(axis=0)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=sizes, default=sizes("64K,256K,1M,4M,16M,64M"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="write the markdown tables here (rank 0)")
    parser.add_argument("--json", help="write every algorithm's median and minimum as rows here (rank 0)")
    parser.add_argument("--dtype", type=choices(sorted(DTYPES)), default=["float32"],
                        help="comma list, or all (default float32)")
    parser.add_argument("--op", type=choices(REDOPS), default=["sum"], help="comma list, or all (default sum)")
    parser.add_argument("--algorithms", type=choices(list(ALLREDUCE)), default=list(ALLREDUCE),
                        help="comma list, or all (default all)")
    parser.add_argument("--rotate", action="store_true",
                        help="rotate the list (in the order given) instead of drawing each repetition's order")
    args = parser.parse_args()
    comm = Communicator(MPI.COMM_WORLD)
    algorithms = args.algorithms
    lines, misses, beyond, cells, rows = [], [], [], 0, []
    for name, op in ((name, op) for name in args.dtype for op in args.op):
        dtype = np.dtype(DTYPES[name])
        try:
            check_dtype_op(dtype, op, "allreduce")
        except TypeError:
            continue  # (a pair the contract refuses: avg of integers, min/max of complex, ...)
        lines += [f"all-reduce of {name} {op}, {comm.size} ranks on {comm.num_nodes} nodes of {comm.node_size}; "
                  f"{comm.selector.network or 'one host: no network measured'}; {args.reps} interleaved calls per "
                  f"algorithm and size ({'rotated' if args.rotate else 'drawn'} order), time of the slowest rank, "
                  "in us (min / median)", "",
                  "| size | " + " | ".join(algorithms) + " | auto chose | best (min) | chosen / best, min | "
                  "best (median) | chosen / best, median (95 %) |",
                  "|---:|" + "---:|" * len(algorithms) + "---|---|---:|---|---:|"]
        for nbytes in args.sizes:
            buf = np.zeros(nbytes // dtype.itemsize, dtype)  # in-place reductions of zeros never overflow
            slowest = interleaved(comm, algorithms, buf, op, args.reps, args.rotate)
            low = {a: float(t.min()) for a, t in slowest.items()}
            mid = {a: float(np.median(t)) for a, t in slowest.items()}
            chosen = comm.selector.choose("allreduce", nbytes, dtype, op)
            best_low, best_mid = min(low, key=lambda a: low[a]), min(mid, key=lambda a: mid[a])
            rows += [{"collective": "allreduce", "size": nbytes, "dtype": name, "redop": op, "algorithm": a,
                      "time_us": mid[a], "min_us": low[a], "times_us": [round(float(us), 2) for us in slowest[a]],
                      "reps": args.reps, "ranks": comm.size, "nodes": comm.num_nodes} for a in algorithms]
            if chosen in slowest:
                cells += 1
                ratio, (lowest, highest) = mid[chosen] / mid[best_mid], ratio_interval(slowest, chosen)
                judged, judged_low = f"{ratio:.2f} ({lowest:.2f}-{highest:.2f})", f"{low[chosen] / low[best_low]:.2f}"
                if ratio > TARGET:
                    misses.append(f"- {name} {op} {human_bytes(nbytes)}: {chosen} {judged} of {best_mid}'s median")
                    if lowest > TARGET:
                        beyond.append(misses[-1])
            else:  # (--algorithms left it out)
                judged = judged_low = "(not timed)"
            lines.append(f"| {human_bytes(nbytes)} | " + " | ".join(f"{low[a]:.4g} / {mid[a]:.4g}" for a in algorithms)
                         + f" | {chosen} | {best_low} | {judged_low} | {best_mid} | {judged} |")
            if comm.rank == 0:
                print(lines[-1], flush=True)
        lines.append("")
    lines += [f"Cells where auto's choice is above {TARGET} of the best by median: {len(misses)} of {cells}", "",
              *misses, "", f"Of them, above {TARGET} over the whole 95 % interval (beyond these repetitions' spread): "
              f"{len(beyond)}", "", *beyond]
    if comm.rank == 0:
        text = "\n".join(lines) + "\n"
        print(text, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        if args.json:
            write_json(rows, args.json)


if __name__ == "__main__":
    main()
