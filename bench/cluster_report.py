"""Tables of an all-reduce sweep on the simulated cluster: every algorithm, what auto chose, and the link bound.

    python bench/cluster_report.py bench/results/cluster_allreduce_2x2.json [...]

Each ``NAME.json`` (mpcomm-bench rows) comes with ``NAME.link.json`` (bench/cluster_link.py: the payload bytes
per second one direction of a node's link carries while both directions are busy). The link bound of an
all-reduce of n bytes over N nodes is the time that rate needs for the 2(N-1)/N n bytes every node must send
(reduce-scatter + all-gather lower bound, whatever the algorithm). Printed per size, times in ms: each fixed
algorithm, auto with its choice, auto / best fixed (issue target <= 1.10), and link bound / best (target >= 0.9
from 16 MiB). Both ratios compare rows of the same run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from mpcomm.bench.report import human_bytes

ORDER = ("ring", "ring_pipelined", "tree", "rhd", "hierarchical", "native")


def report(path: str) -> str:
    rows = json.loads(Path(path).read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    link = json.loads(Path(path).with_suffix(".link.json").read_text())
    nodes, rate = int(link["nodes"]), float(link["bytes_per_second"])
    by_size: dict[int, dict[str, dict]] = {}
    for row in rows:
        by_size.setdefault(int(row["size"]), {})[row["algorithm"]] = row
    names = [a for a in ORDER if any(a in algs for algs in by_size.values())]
    lines = [f"### {Path(path).name}: {nodes} nodes, link payload rate {rate * 8 / 1e9:.3f} Gbit/s per direction", "",
             "| size | " + " | ".join(names) + " | auto (chose) | best | auto / best | link bound | link bound / best |",
             "|---:|" + "---:|" * len(names) + "---|---|---:|---:|---:|"]
    worst_auto, worst_link = 0.0, float("inf")
    for size, algs in sorted(by_size.items()):
        fixed = {a: algs[a]["time_us"] / 1e3 for a in names if a in algs}
        best = min(fixed, key=fixed.get)
        auto = algs.get("auto")
        bound = 2 * (nodes - 1) / nodes * size / rate * 1e3
        cells = " | ".join(f"{fixed[a]:.2f}" if a in fixed else "" for a in names)
        if auto is not None:
            ratio = auto["time_us"] / 1e3 / fixed[best]
            worst_auto = max(worst_auto, ratio)
            auto_cell = f"{auto['time_us'] / 1e3:.2f} ({auto.get('resolved', '?')})"
            ratio_cell = f"{ratio:.2f}"
        else:
            auto_cell = ratio_cell = ""
        link_ratio = bound / fixed[best]
        if size >= 16 << 20:
            worst_link = min(worst_link, link_ratio)
        lines.append(f"| {human_bytes(size)} | {cells} | {auto_cell} | {best} | {ratio_cell} | {bound:.2f} | {link_ratio:.2f} |")
    lines += ["", f"worst auto / best: **{worst_auto:.2f}**; lowest link bound / best from 16 MiB: "
              f"**{worst_link:.2f}**", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n".join(report(p) for p in sys.argv[1:]))
