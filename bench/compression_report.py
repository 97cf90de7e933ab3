"""Table of compressed all-reduce runs (mpcomm-bench --wire): float32 rows against the wire rows, with the link bound.

    python bench/compression_report.py bench/results/compression_2x1_*.json [--link bench/results/compression_2x1.link.json]

Each JSON is one mpcomm-bench run (its rows are medians of round-robin rounds); the runs are repeats of the same
command. Per size and row: min / median / max over the repeats, in ms. With ``--link`` (bench/cluster_link.py:
payload bytes per second of one direction of a node's link while both are busy) the float32 link bound — the time
the link needs for the 2(N-1)/N n bytes every node must send in float32 — and each row's speed against it
(link bound / median time: 1.8 means 1.8x the float32 link-bound rate).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mpcomm.bench.report import human_bytes


def report(paths: list[str], link_path: str | None) -> str:
    times: dict[int, dict[str, list[float]]] = {}
    for path in paths:
        rows = json.loads(Path(path).read_text())
        for row in rows["rows"] if isinstance(rows, dict) else rows:
            name = row["algorithm"] if row["algorithm"] != "auto" else f"auto ({row['resolved']})"
            times.setdefault(int(row["size"]), {}).setdefault(name, []).append(row["time_us"] / 1e3)
    link = json.loads(Path(link_path).read_text()) if link_path else None
    lines = []
    if link:
        lines += [f"link payload rate {link['bytes_per_second'] * 8 / 1e9:.3f} Gbit/s per direction, "
                  f"{link['nodes']} nodes", ""]
    lines += ["| size | row | min ms | median ms | max ms | repeats | x float32 link bound | float32 best median / this |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for size, rows in sorted(times.items()):
        bound = 2 * (link["nodes"] - 1) / link["nodes"] * size / link["bytes_per_second"] * 1e3 if link else None
        plain = min(statistics.median(v) for name, v in rows.items() if not name.startswith("wire:"))
        for name, values in rows.items():
            median = statistics.median(values)
            against = f"{bound / median:.2f}" if bound else "-"
            lines.append(f"| {human_bytes(size)} | {name} | {min(values):.4g} | {median:.4g} | {max(values):.4g} | "
                         f"{len(values)} | {against} | {plain / median:.2f} |")
        if bound:
            lines.append(f"| {human_bytes(size)} | float32 link bound | | {bound:.4g} | | | 1.00 | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--link")
    args = parser.parse_args()
    print(report(args.runs, args.link))


if __name__ == "__main__":
    main()
