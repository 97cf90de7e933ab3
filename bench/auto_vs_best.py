"""How close ``auto`` came to the best fixed algorithm at every size of mpcomm-bench sweeps (rows JSON).

    python bench/auto_vs_best.py bench/results/allreduce_p2.json [...]
    python bench/auto_vs_best.py --times bench/results/alltoall_p2.json     # + every algorithm's time

Prints, per file, a markdown table: size, the fastest fixed algorithm and its time, native's time, what auto
chose and its time, and auto / best (issue target: <= 1.10 at every size). Both times are measured in the
same run; when auto chose the best algorithm the ratio shows the run-to-run noise of one algorithm.
``--times`` adds a column per algorithm (time in us, the raw mpi4py call included), in the sweep's row order.
"""
from __future__ import annotations

import argparse
import json

RAW = "mpi4py-raw"  # mpcomm-bench's overhead baseline: the MPI call straight from mpi4py, not an mpcomm algorithm


def summary(path: str, times: bool = False) -> str:
    with open(path) as f:
        rows = json.load(f)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    by_size: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_size.setdefault(row["size"], {})[row["algorithm"]] = row
    names = list(dict.fromkeys(row["algorithm"] for row in rows if row["algorithm"] != "auto")) if times else []
    head = "| size (B) | " + "".join(f"{name} us | " for name in names)
    lines = [f"### {path}", "", head + "best fixed | us | native us | auto chose | auto us | auto / best |",
             "|---:|" + "---:|" * len(names) + "---|---:|---:|---|---:|---:|"]
    worst = 0.0
    for size, algs in sorted(by_size.items()):
        if "auto" not in algs:
            continue
        # mpcomm's fixed algorithms: not auto, not the raw mpi4py row
        best = min((r for name, r in algs.items() if name not in ("auto", RAW)), key=lambda r: r["time_us"])
        auto = algs["auto"]
        ratio = auto["time_us"] / best["time_us"]
        worst = max(worst, ratio)
        native = algs.get("native", {}).get("time_us", float("nan"))
        each = "".join(f"{algs[name]['time_us']:.1f} | " if name in algs else "- | " for name in names)
        lines.append(f"| {size} | {each}{best['algorithm']} | {best['time_us']:.1f} | {native:.1f} | "
                     f"{auto['resolved']} | {auto['time_us']:.1f} | {ratio:.2f} |")
    lines += ["", f"worst auto / best: **{worst:.2f}**", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="mpcomm-bench --json files")
    parser.add_argument("--times", action="store_true", help="a time column per algorithm (raw row included)")
    args = parser.parse_args(argv)
    print("\n".join(summary(path, args.times) for path in args.files))


if __name__ == "__main__":
    main()
