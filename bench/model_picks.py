"""What the cost model installed on ``PYTHONPATH`` would have chosen in measured sweeps, judged by their times.

    python bench/model_picks.py --library mpich --ranks-per-core 2 bench/results/shared_cores_p4_s36_{1,2,3,4}.json
    PYTHONPATH=<a worktree of an older commit> python bench/model_picks.py ...   # the older model on the same runs

For every (dtype, op, size) cell of the mpcomm-bench runs (rows JSON, one node, one collective), each fixed
algorithm's time is its median over the runs; the model's pick among the algorithms the runs timed (auto's model
for the library's profile, ``--ranks-per-core`` ranks on each core) is judged by that time over the fastest one's.
Comparing two models on the same runs this way sees no run-to-run noise between them, only in the runs themselves.
Prints the cells, how many are above 1.10, the geometric mean and the worst, and those above 1.10.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import statistics

import numpy as np

from mpcomm.algorithms.auto import CostModel, Layout
from mpcomm.bench.cli import DTYPES
from mpcomm.mpi_library import PROFILES

NOT_FIXED = ("auto", "mpi4py-raw")  # auto's own column and the raw MPI call are not candidates
TARGET = 1.10


def median_times(paths: list[str]) -> tuple[str, int, dict]:
    """(the collective, the ranks, {(dtype, op, size): {algorithm: median microseconds over the runs}})."""
    times: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    kinds = set()
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        for row in rows["rows"] if isinstance(rows, dict) else rows:
            kinds.add((row["collective"], row["ranks"]))
            if row["algorithm"] not in NOT_FIXED:
                times[(row["dtype"], row["redop"], row["size"])][row["algorithm"]].append(row["time_us"])
    if len(kinds) != 1:
        raise SystemExit(f"model_picks.py: the runs mix collectives or ranks: {sorted(kinds)}")
    (collective, ranks), = kinds
    return collective, ranks, {cell: {a: statistics.median(t) for a, t in algs.items()} for cell, algs in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=sorted(PROFILES), required=True)
    parser.add_argument("--ranks-per-core", type=float, default=1.0)
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    collective, ranks, cells = median_times(args.runs)
    layout = Layout(ranks, (ranks,), args.ranks_per_core)
    model = CostModel.of_library(PROFILES[args.library]).for_layout(layout)
    ratios, misses = [], []
    for (dtype, op, size), times in sorted(cells.items()):
        nbytes = size // ranks if collective == "reduce_scatter" else size  # (the model prices the output's bytes)
        pick = min(times, key=lambda a: model.call(collective, a, nbytes, layout, np.dtype(DTYPES[dtype]), op))
        ratio = times[pick] / min(times.values())
        ratios.append(ratio)
        if ratio > TARGET:
            misses.append(f"{dtype} {op} {size}: {pick} {ratio:.2f}")
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"{collective}, p = {ranks}, {args.ranks_per_core:g} ranks per core, {len(args.runs)} runs: {len(ratios)} "
          f"cells, {len(misses)} above {TARGET}, geometric mean {mean:.3f}, worst {max(ratios):.2f}")
    for miss in misses:
        print("  " + miss)


if __name__ == "__main__":
    main()
