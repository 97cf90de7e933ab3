"""How close ``auto`` came to the best fixed algorithm at every size of mpcomm-bench sweeps (rows JSON).

    python bench/auto_vs_best.py bench/results/allreduce_p2.json [...]

Prints, per file, a markdown table: size, the fastest fixed algorithm and its time, native's time, what auto
chose and its time, and auto / best (issue target: <= 1.10 at every size). Both times are measured in the
same run; when auto chose the best algorithm the ratio shows the run-to-run noise of one algorithm.
"""
from __future__ import annotations

import json
import sys


def summary(path: str) -> str:
    with open(path) as f:
        rows = json.load(f)
    rows = rows["rows"] if isinstance(rows, dict) else rows
    by_size: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_size.setdefault(row["size"], {})[row["algorithm"]] = row
    lines = [f"### {path}", "", "| size (B) | best fixed | us | native us | auto chose | auto us | auto / best |",
             "|---:|---|---:|---:|---|---:|---:|"]
    worst = 0.0
    for size, algs in sorted(by_size.items()):
        if "auto" not in algs:
            continue
        # mpcomm's fixed algorithms: not auto, not the raw mpi4py row (mpcomm-bench's overhead baseline)
        best = min((r for name, r in algs.items() if name not in ("auto", "mpi4py-raw")), key=lambda r: r["time_us"])
        auto = algs["auto"]
        ratio = auto["time_us"] / best["time_us"]
        worst = max(worst, ratio)
        native = algs.get("native", {}).get("time_us", float("nan"))
        lines.append(f"| {size} | {best['algorithm']} | {best['time_us']:.1f} | {native:.1f} | {auto['resolved']} | "
                     f"{auto['time_us']:.1f} | {ratio:.2f} |")
    lines += ["", f"worst auto / best: **{worst:.2f}**", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n".join(summary(p) for p in sys.argv[1:]))
