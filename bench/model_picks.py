"""What the cost model installed on ``PYTHONPATH`` would have chosen in measured sweeps, judged by their times.

    python bench/model_picks.py --library mpich --ranks-per-core 2 bench/results/shared_cores_p4_s36_{1,2,3,4}.json
    PYTHONPATH=<a worktree of an older commit> python bench/model_picks.py ...   # the older model on the same runs

For every (dtype, op, size) cell of the mpcomm-bench runs (rows JSON, one node, one collective), each fixed
algorithm's time is its median over the runs; the model's pick among the algorithms the runs timed (auto's model
for the library's profile, ``--ranks-per-core`` ranks on each core) is judged by that time over the fastest one's.
Comparing two models on the same runs this way sees no run-to-run noise between them, only in the runs themselves.
Prints the cells, how many are above 1.10, the geometric mean and the worst, and those above 1.10.

``--held-out`` asks how far run-to-run noise alone puts a pick above 1.10 (needs 3 runs or more). Each run in
turn is held out and judges two picks per cell by its own times: the measured one (the fastest by the median of
the other runs: what a table tuned on those runs would run) and the model's. Where the model's count is not above
the measured picks' count, these runs cannot tell the model from the best any measurement of them gives.

``--picked-by RUNS...`` asks whether two ways of timing agree on the best: the pick of those runs' medians (e.g.
mpcomm-bench's sweeps, blocks of calls) judged by the medians of the runs given (e.g. ``cluster_auto_check.py
--json``, calls interleaved), in the cells both timed, beside the model's pick judged the same way.
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


def runs_of(paths: list[str]) -> tuple[str, int, list[dict]]:
    """(the collective, the ranks, per run {(dtype, op, size): {algorithm: microseconds}}), fixed algorithms only."""
    runs, kinds = [], set()
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        cells: dict = collections.defaultdict(dict)
        for row in rows["rows"] if isinstance(rows, dict) else rows:
            kinds.add((row["collective"], row["ranks"]))
            if row["algorithm"] not in NOT_FIXED:
                cells[(row["dtype"], row["redop"], row["size"])][row["algorithm"]] = row["time_us"]
        runs.append(cells)
    if len(kinds) != 1:
        raise SystemExit(f"model_picks.py: the runs mix collectives or ranks: {sorted(kinds)}")
    (collective, ranks), = kinds
    return collective, ranks, runs


def median_times(runs: list[dict]) -> dict:
    """{(dtype, op, size): {algorithm: its median microseconds over ``runs`` that timed it}}."""
    cells: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for run in runs:
        for cell, times in run.items():
            for algorithm, us in times.items():
                cells[cell][algorithm].append(us)
    return {cell: {a: statistics.median(t) for a, t in algs.items()} for cell, algs in cells.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", choices=sorted(PROFILES), required=True)
    parser.add_argument("--ranks-per-core", type=float, default=1.0)
    parser.add_argument("--held-out", action="store_true", help="also judge by each run held out (see above)")
    parser.add_argument("--picked-by", nargs="+", metavar="RUN", help="also judge the pick of these runs' medians")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    collective, ranks, runs = runs_of(args.runs)
    if args.held_out and len(runs) < 3:
        parser.error(f"--held-out needs 3 runs or more (the others' median picks), got {len(runs)}")
    layout = Layout(ranks, (ranks,), args.ranks_per_core)
    model = CostModel.of_library(PROFILES[args.library]).for_layout(layout)

    def model_pick(cell: tuple, times: dict) -> str:
        dtype, op, size = cell
        nbytes = size // ranks if collective == "reduce_scatter" else size  # (the model prices the output's bytes)
        return min(times, key=lambda a: model.call(collective, a, nbytes, layout, np.dtype(DTYPES[dtype]), op))

    ratios, misses = [], []
    for cell, times in sorted(median_times(runs).items()):
        pick = model_pick(cell, times)
        ratio = times[pick] / min(times.values())
        ratios.append(ratio)
        if ratio > TARGET:
            misses.append(f"{cell[0]} {cell[1]} {cell[2]}: {pick} {ratio:.2f}")
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"{collective}, p = {ranks}, {args.ranks_per_core:g} ranks per core, {len(runs)} runs: {len(ratios)} "
          f"cells, {len(misses)} above {TARGET}, geometric mean {mean:.3f}, worst {max(ratios):.2f}")
    for miss in misses:
        print("  " + miss)
    if args.held_out:
        judged = measured_above = model_above = 0
        for held in range(len(runs)):
            others = median_times(runs[:held] + runs[held + 1:])
            for cell, times in runs[held].items():
                tuned = {a: us for a, us in others.get(cell, {}).items() if a in times}
                if not tuned:
                    continue
                best = min(times.values())
                judged += 1
                measured_above += times[min(tuned, key=tuned.__getitem__)] / best > TARGET
                model_above += times[model_pick(cell, times)] / best > TARGET
        print(f"held out, each run judging: {judged} cells; above {TARGET}: the measured pick (the other runs' "
              f"median best) {measured_above}, the model's {model_above}")
    if args.picked_by:
        other_collective, other_ranks, others = runs_of(args.picked_by)
        if (other_collective, other_ranks) != (collective, ranks):
            raise SystemExit(f"model_picks.py: --picked-by runs are {other_collective} at p = {other_ranks}, the runs "
                             f"{collective} at p = {ranks}")
        picked, judging = median_times(others), median_times(runs)
        cells = [(cell, {a: us for a, us in times.items() if a in picked[cell]})
                 for cell, times in judging.items() if cell in picked]
        above = collections.Counter()
        for cell, times in cells:
            best = min(times.values())
            above["picked"] += times[min(times, key=lambda a: picked[cell][a])] / best > TARGET
            above["model"] += times[model_pick(cell, times)] / best > TARGET
        print(f"picked by the other runs' medians, judged by these: {len(cells)} cells; above {TARGET}: their pick "
              f"{above['picked']}, the model's {above['model']}")


if __name__ == "__main__":
    main()
