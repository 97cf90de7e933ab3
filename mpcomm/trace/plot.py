"""A picture of a timeline file (matplotlib): one band per rank, one row per track, a bar per span, the phases
drawn inside their call. For documentation; Perfetto (ui.perfetto.dev) or chrome://tracing open the file itself.

    python -m mpcomm.trace.plot TIMELINE.json OUT.png [--start MS] [--end MS] [--title TEXT]
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

_COLOURS = {"collective": "#4c72b0", "phase": "#dd8452", "engine": "#55a868", "p2p": "#8172b3"}


def plot(path: str, out: str, start_ms: float | None = None, end_ms: float | None = None, title: str = "") -> None:
    """Draw the spans of ``path`` between ``start_ms`` and ``end_ms`` (default: all) into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    ranks = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"
             and (start_ms is None or e["ts"] + e["dur"] >= start_ms * 1e3)
             and (end_ms is None or e["ts"] <= end_ms * 1e3)]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    row_of = {key: i for i, key in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.2))
    for e in spans:
        phase = e["cat"] == "phase"
        y = row_of[e["pid"], e["tid"]] + (0.2 if phase else 0.0)
        ax.barh(y, e["dur"] / 1e3, left=e["ts"] / 1e3, height=0.4 if phase else 0.8,
                color=_COLOURS.get(e["cat"], "grey"), edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{ranks.get(pid, pid)}  {tracks[pid, tid]}" for pid, tid in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title(title or path, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, list(_COLOURS), loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpcomm.trace.plot", description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("out")
    parser.add_argument("--start", type=float, default=None, help="first ms shown")
    parser.add_argument("--end", type=float, default=None, help="last ms shown")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    plot(args.timeline, args.out, args.start, args.end, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
