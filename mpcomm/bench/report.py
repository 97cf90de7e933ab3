"""The nccl-tests-like table, the JSON rows and the bandwidth plot."""
from __future__ import annotations

import json
import statistics
from typing import Iterable

from .base import RAW

COLUMNS = ("size", "count", "type", "redop", "algorithm", "time_us", "algbw", "busbw", "#wrong", "vs_native",
           "overhead")
_WIDTHS = (12, 12, 10, 6, 20, 12, 10, 10, 8, 9, 9)
UNITS = ("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(x)", "(x)")


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def header_lines(meta: dict) -> list[str]:
    rpn = meta.get("ranks_per_node")
    nodes = f"nodes {meta['nodes']} ({'ranks_per_node=%d, simulated' % rpn if rpn else 'detected by shared memory'})"
    lines = [
        f"# mpcomm-bench: {meta['operation']}",
        f"# MPI library: {meta['mpi_library']}",
        f"# mpi4py {meta['mpi4py']}, numpy {meta['numpy']}, python {meta['python']}",
        f"# ranks {meta['ranks']}   {nodes}",
        f"# dtype {','.join(meta['dtypes'])}   redop {','.join(meta['redops'])}"
        + (f"   root {meta['root']}" if meta.get("rooted") else ""),
        f"# algorithms {','.join(meta['algorithms'])}   ({RAW}: MPI.Comm.{meta['raw_call']} straight from mpi4py, "
        "the overhead baseline" + ("; native always timed: the vs_native baseline)" if meta.get("native_added")
                                   else ")"),
        f"# sizes {human_bytes(meta['minbytes'])} .. {human_bytes(meta['maxbytes'])} (x{meta['stepfactor']})   "
        f"check {'on' if meta['check'] else 'off'}",
        (f"# timed blocks of {meta['block_ms']:g} ms or {meta['iters']} calls, whichever first, <= "
         f"{meta['budget'] / meta['rounds']:.3g} s each (calibrated after >= {meta['warmup']} warm-up calls)"
         if meta["warmup"] else f"# timed blocks of exactly {meta['iters']} calls (-w 0: no warm-up, no calibration)")
        + f"; {meta['rounds']} round-robin rounds per point",
        f"# memcpy {meta['memcpy_GBps']:.2f} GB/s (numpy copy of {human_bytes(meta['memcpy_bytes'])} on rank 0): "
        "the intra-node physical ceiling",
        "# size: bytes of the full buffer; count: elements "
        + ("per rank (per peer for alltoall)" if meta.get("per_rank_count") else "of the buffer") + ", as nccl-tests",
        "# time: median over rounds of (max over ranks of the mean per-call time); busbw = algbw * "
        f"{meta['busbw_formula']}",
        "# vs_native = native time / this time (>1: faster than native); "
        f"overhead = this time / {RAW} time (what mpcomm adds to the MPI call; <1: faster than it)",
    ]
    if meta.get("skipped"):
        lines.append(f"# skipped (unsupported by the contract): {', '.join(meta['skipped'])}")
    lines.append("#")
    lines.append("#" + " ".join(c.rjust(w) for c, w in zip(COLUMNS, _WIDTHS))[1:])
    lines.append("#" + " ".join(u.rjust(w) for u, w in zip(UNITS, _WIDTHS))[1:])
    return lines


def format_row(row: dict) -> str:
    algorithm = row["algorithm"]
    if algorithm == "auto" and row.get("resolved"):
        algorithm = f"auto({row['resolved']})"
    wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
    if row.get("identical") is False:
        wrong += "!"  # results differ between ranks
    vs = "-" if row.get("vs_native") is None else f"{row['vs_native']:.2f}"
    overhead = "-" if row.get("overhead") is None else f"{row['overhead']:.2f}"
    cells = (
        str(row["size"]), str(row["count"]), row["dtype"], row["op"], algorithm,
        f"{row['time_us']:.1f}", f"{row['algbw']:.3f}", f"{row['busbw']:.3f}", wrong, vs, overhead,
    )
    return " ".join(c.rjust(w) for c, w in zip(cells, _WIDTHS))


def footer_lines(rows: list[dict], check: bool) -> list[str]:
    lines = []
    if check:
        wrong = sum(r["wrong"] or 0 for r in rows)
        differ = sum(1 for r in rows if r.get("identical") is False)
        status = "OK" if wrong == 0 and differ == 0 else "FAILED"
        lines.append(f"# wrong elements in total: {wrong}; rows whose results differ between ranks: {differ}  {status}")
    by_algorithm: dict[str, list[dict]] = {}
    for row in rows:
        by_algorithm.setdefault(row["algorithm"], []).append(row)
    averages = ", ".join(f"{a} {statistics.fmean(r['busbw'] for r in rs):.3f}" for a, rs in by_algorithm.items())
    lines.append(f"# average busbw (GB/s): {averages}")
    overheads = ", ".join(f"{a} {statistics.median(r['overhead'] for r in rs):.2f}" for a, rs in by_algorithm.items()
                          if a != RAW and all(r.get("overhead") is not None for r in rs))
    if overheads:
        lines.append(f"# median overhead over {RAW} (x): {overheads}")
    return lines


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


def plot(rows: Iterable[dict], path: str, meta: dict) -> None:
    """busbw vs size (log-x), one line per algorithm (and dtype/redop when several), memcpy as a ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    several = len({(r["dtype"], r["op"]) for r in rows}) > 1
    lines: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        label = row["algorithm"] + (f" {row['dtype']} {row['op']}" if several else "")
        lines.setdefault(label, []).append((row["size"], row["busbw"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, points in lines.items():
        xs, ys = zip(*sorted(points))
        style = (dict(color="black", linewidth=2.2) if label.startswith("native") else
                 dict(color="black", linewidth=1.2, linestyle=":") if label.startswith(RAW) else {})
        ax.plot(xs, ys, marker="o", markersize=3, label=label, **style)
    if meta.get("memcpy_GBps"):
        ax.axhline(meta["memcpy_GBps"], color="grey", linestyle="--", linewidth=1,
                   label=f"memcpy {meta['memcpy_GBps']:.1f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    rpn = meta.get("ranks_per_node")
    ax.set_title(f"mpcomm-bench {meta['operation']}: {meta['ranks']} ranks, {meta['nodes']} node(s)"
                 f"{' (simulated)' if rpn else ''}, {','.join(meta['dtypes'])} {','.join(meta['redops'])}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
