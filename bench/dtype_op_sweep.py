"""Every (dtype, op) of an ``mpcomm-bench --dtype all --redop all`` sweep (rows JSON), against the best fixed
algorithm and against float32 ``sum``.

    python bench/dtype_op_sweep.py bench/results/dtype_op_p2.json bench/results/dtype_op_p2_64M.json

Prints, for the rows of all the files together (one communicator size: e.g. one sweep's sizes and another's), two
markdown tables with one row per (dtype, op) and one column per size:
* ``auto / best``: auto's time over the fastest fixed mpcomm algorithm's at that point (issue 27 target: <= 1.10),
  with the algorithm auto chose when it was not that one;
* ``per byte vs float32 sum``: the time of the best algorithm of this (dtype, op) over the best of float32 ``sum``
  at the same size in bytes (targets: 16-bit sums <= 1.5 from 1 MiB, ints' sums <= 1.2, float32/float64 ops
  <= 1.2 x the same dtype's sum).
Every time was measured in the same run, interleaved with the others of its point. With ``--runs`` the files are
repeated runs of one sweep: auto / best per cell is their median, and the cells above 1.10 in every run are listed.

    python bench/dtype_op_sweep.py --runs bench/results/dtype_op_p2_s34_{1,2,3}.json
"""
from __future__ import annotations

import argparse
import json

RAW = "mpi4py-raw"  # the MPI call straight from mpi4py: a baseline, not an mpcomm algorithm


def load(paths: list[str]) -> dict[tuple[str, str, int], dict[str, dict]]:
    """(dtype, redop, size) -> algorithm -> row, over all ``paths``."""
    points: dict[tuple[str, str, int], dict[str, dict]] = {}
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        for row in rows["rows"] if isinstance(rows, dict) else rows:
            points.setdefault((row["dtype"], row["redop"], row["size"]), {})[row["algorithm"]] = row
    return points


def best(algorithms: dict[str, dict]) -> dict:
    return min((r for name, r in algorithms.items() if name not in ("auto", RAW)), key=lambda r: r["time_us"])


def tables(paths: list[str]) -> str:
    points = load(paths)
    sizes = sorted({size for _, _, size in points})
    pairs = list(dict.fromkeys((dtype, redop) for dtype, redop, _ in points))
    head = "| dtype | op | " + " | ".join(_human(s) for s in sizes) + " | worst |"
    rule = "|---|---|" + "---:|" * (len(sizes) + 1)
    auto_lines, byte_lines = [head, rule], [head, rule]
    worst_auto = 0.0
    for dtype, redop in pairs:
        ratios, per_byte = [], []
        for size in sizes:
            algorithms = points.get((dtype, redop, size))
            if not algorithms or "auto" not in algorithms:
                ratios.append(None)
                per_byte.append(None)
                continue
            fastest, auto = best(algorithms), algorithms["auto"]
            ratio = auto["time_us"] / fastest["time_us"]
            chose = "" if auto["resolved"] == fastest["algorithm"] else f" ({auto['resolved']}; {fastest['algorithm']})"
            ratios.append((ratio, chose))
            reference = points.get(("float32", "sum", size))
            per_byte.append(fastest["time_us"] / best(reference)["time_us"] if reference else None)
        seen = [r for r, _ in filter(None, ratios)]
        worst_auto = max([worst_auto, *seen])
        auto_lines.append(f"| {dtype} | {redop} | " + " | ".join("-" if r is None else f"{r[0]:.2f}{r[1]}"
                                                                  for r in ratios)
                          + f" | **{max(seen, default=float('nan')):.2f}** |")
        values = [v for v in per_byte if v is not None]
        byte_lines.append(f"| {dtype} | {redop} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in per_byte)
                          + f" | **{max(values, default=float('nan')):.2f}** |")
    return "\n".join([f"### {', '.join(paths)}", "", "auto / best fixed (auto's choice; the best, where they differ):", "",
                      *auto_lines, "", f"worst auto / best: **{worst_auto:.2f}**", "",
                      "best time of this (dtype, op) / best time of float32 sum, same bytes:", "", *byte_lines, ""])


def repeated(paths: list[str], target: float = 1.10) -> str:
    """Sweeps of the same points, one per file: per (dtype, op) and size, auto / best of each run (both timed in
    that run), as the median over the runs; and the cells above ``target`` in every run (where noise, which moves
    a cell from run to run, does not explain the miss)."""
    runs = [load([path]) for path in paths]
    common = set(runs[0]).intersection(*runs[1:])
    sizes = sorted({size for _, _, size in common})
    pairs = list(dict.fromkeys((dtype, redop) for dtype, redop, _ in sorted(common, key=lambda k: (k[0], k[1]))))
    lines = ["| dtype | op | " + " | ".join(_human(s) for s in sizes) + " | worst |",
             "|---|---|" + "---:|" * (len(sizes) + 1)]
    always, medians = [], []
    for dtype, redop in pairs:
        cells = []
        for size in sizes:
            key = (dtype, redop, size)
            ratios = sorted(run[key]["auto"]["time_us"] / best(run[key])["time_us"] for run in runs
                            if key in common and "auto" in run[key])
            if not ratios:
                cells.append(None)
                continue
            cells.append(ratios[len(ratios) // 2])
            if ratios[0] > target:
                chose = {run[key]["auto"]["resolved"] for run in runs}
                fastest = {best(run[key])["algorithm"] for run in runs}
                always.append(f"{dtype} {redop} {_human(size)}: {ratios[0]:.2f}-{ratios[-1]:.2f} (auto took "
                              f"{'/'.join(sorted(chose))}; best {'/'.join(sorted(fastest))})")
        seen = [c for c in cells if c is not None]
        medians.extend(seen)
        lines.append(f"| {dtype} | {redop} | " + " | ".join("-" if c is None else f"{c:.2f}" for c in cells)
                     + f" | **{max(seen, default=float('nan')):.2f}** |")
    above = sum(m > target for m in medians)
    return "\n".join([f"### {len(paths)} runs: {', '.join(paths)}", "", "auto / best fixed, median of the runs "
                      f"({above} of {len(medians)} cells above {target}):", "",
                      *lines, "", f"above {target} in every run ({len(always)}):", "",
                      *(f"- {cell}" for cell in always), ""])


def _human(nbytes: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g}{unit}"
    return f"{nbytes}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="mpcomm-bench --json files")
    parser.add_argument("--runs", action="store_true",
                        help="the files are runs of the same sweep: auto / best per cell as the median of the runs")
    args = parser.parse_args(argv)
    print(repeated(args.files) if args.runs else tables(args.files))


if __name__ == "__main__":
    main()
