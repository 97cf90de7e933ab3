"""An A/B of mpcomm-bench runs off float32 sum's path (before/after a change, interleaved runs of each): per run,
the time of each op over the same dtype's sum, and the per-byte time of 16-bit sums over float32's.

Files are mpcomm-bench --json outputs named ..._<tree>_<run>.json (e.g. dtype_op_ab_small_after_2.json); the tree
token groups them. Commands and results: bench/results/dtype_op.md ("Stop 28").

    python bench/dtype_op_ab.py --small bench/results/dtype_op_ab_small_*.json \
        --mid bench/results/dtype_op_ab_mid_*.json --big bench/results/mixed_vs_f32_ab_*.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics

FIXED_ONLY = ("auto", "mpi4py-raw")


def load(paths: list[str]) -> dict[str, list[dict]]:
    """{tree: [{(dtype, op, size, algorithm): microseconds} per run]}, runs in file-name order."""
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    for path in sorted(paths):
        tree = path.rsplit("_", 2)[-2]
        runs[tree].append({(r["dtype"], r["op"], r["size"], r["algorithm"]): r["time_us"] for r in json.load(open(path))})
    return runs


def best(run: dict, dtype: str, op: str, size: int) -> float:
    """The best fixed algorithm's time (auto and raw mpi4py left out)."""
    return min(t for (d, o, s, a), t in run.items() if (d, o, s) == (dtype, op, size) and a not in FIXED_ONLY)


def sizes(runs: dict[str, list[dict]]) -> list[int]:
    return sorted({key[2] for tree in runs.values() for run in tree for key in run})


def small(runs: dict[str, list[dict]]) -> None:
    print("native's time of the op / native's time of the same dtype's sum, per run (8 B - 4 KiB)")
    for tree, tree_runs in runs.items():
        print(f"== {tree}")
        for dtype in ("float32", "float64"):
            for op in ("max", "min", "avg"):
                for size in sizes(runs):
                    ratios = [r[(dtype, op, size, "native")] / r[(dtype, "sum", size, "native")] for r in tree_runs]
                    print(f"  {dtype} {op} {size:6d} B: " + " ".join(f"{x:.2f}" for x in ratios))


def mid(runs: dict[str, list[dict]]) -> None:
    print("best fixed time of the op / best fixed time of the same dtype's sum, per run (auto / best of the op)")
    for tree, tree_runs in runs.items():
        print(f"== {tree}")
        for dtype in ("float32", "float64"):
            for op in ("avg", "max"):
                for size in sizes(runs):
                    cells = [f"{best(r, dtype, op, size) / best(r, dtype, 'sum', size):.2f} "
                             f"({r[(dtype, op, size, 'auto')] / best(r, dtype, op, size):.2f})" for r in tree_runs]
                    print(f"  {dtype} {op} {size >> 10:6d} KiB: " + "  ".join(cells))


def big(runs: dict[str, list[dict]]) -> None:
    print("best fixed time of a 16-bit sum / best fixed time of float32's sum, same bytes, per run (auto / best)")
    for tree, tree_runs in runs.items():
        print(f"== {tree}")
        for dtype in ("bfloat16", "float16"):
            for size in sizes(runs):
                cells = [f"{best(r, dtype, 'sum', size) / best(r, 'float32', 'sum', size):.2f} "
                         f"({r[(dtype, 'sum', size, 'auto')] / best(r, dtype, 'sum', size):.2f})" for r in tree_runs]
                print(f"  {dtype} {size >> 20:3d} MiB: " + "  ".join(cells))


def cells(runs: dict[str, list[dict]]) -> None:
    print("median time after / median time before, per (dtype, op, size) and algorithm (raw: the MPI call itself,"
          " unchanged: the drift between the trees' runs)")
    before, after = runs["before"], runs["after"]
    keys = sorted(set(before[0]) & set(after[0]))
    algorithms = sorted({key[3] for key in keys})
    print(f"{'':24}" + "".join(f"{a[:14]:>15}" for a in algorithms))
    for dtype, op, size in sorted({key[:3] for key in keys}):
        medians = [statistics.median(r[(dtype, op, size, a)] for r in after)
                   / statistics.median(r[(dtype, op, size, a)] for r in before) for a in algorithms]
        print(f"{dtype:8} {op:4} {size >> 10:7d} KiB" + "".join(f"{m:15.2f}" for m in medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", nargs="*", default=[], help="runs of -b 8 -e 4K, ops sum/max/min/avg, native")
    parser.add_argument("--mid", nargs="*", default=[], help="runs of -b 32K -e 16M, ops sum/avg/max")
    parser.add_argument("--big", nargs="*", default=[], help="runs of float32/bfloat16/float16 sums from 4 MiB")
    parser.add_argument("--cells", nargs="*", default=[], help="runs of trees named before and after, any cells")
    args = parser.parse_args()
    for paths, report in ((args.small, small), (args.mid, mid), (args.big, big), (args.cells, cells)):
        if paths:
            report(load(paths))


if __name__ == "__main__":
    main()
