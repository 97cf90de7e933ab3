"""Report of bench/cluster_ddp_compression.sh: step time and loss of ``mpcomm-train --engine ddp|fsdp`` per
``--compression`` mode, from the runs' ``--json`` files (``<mode>.r<round>.json``), as markdown on stdout.

    python bench/ddp_compression.py --where "ci/cluster.sh 2 1 1gbit" --command "..." --modes "none auto" DIR/*.json

Step time: the median of each run's steps after the first ``--skip`` (the compression warm-up and the first
steps' allocations), then the median, min and max of that over the rounds; the speed-up against ``none`` is per
round (runs of one round ran back to back). Loss: the last step's and the mean of the last 10 (the batches are
the same for every mode: the same step sees the same data).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from collections import defaultdict

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--where", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--modes", required=True)
    ap.add_argument("--load-before", default="?")
    ap.add_argument("--load-after", default="?")
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    runs: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in args.files:
        m = re.fullmatch(r"(.+)\.r(\d+)\.json", os.path.basename(path))
        assert m, path
        with open(path) as f:
            runs[m.group(1)][int(m.group(2))] = json.load(f)
    modes = args.modes.split()
    key = {mode: re.sub(r"[:/]", "_", mode) for mode in modes}
    base = runs[key["none"]] if "none" in modes else None
    any_run = next(iter(next(iter(runs.values())).values()))
    cfg = any_run["config"]
    engine = any_run["engine"]
    print(f"# {engine.upper()} gradient compression: mpcomm-train --engine {engine}, {args.where}\n")
    print(f"Reproduce with `{args.command}`.\n")
    print(f"Model: {cfg['layers']} transformer MLP blocks, d_model {cfg['d_model']}, d_hidden {cfg['d_hidden']}, "
          f"{cfg['dtype']}, global batch {cfg['global_batch']}, optimizer {cfg['optimizer']} lr {cfg['lr']}, "
          f"{cfg['steps']} steps, world {any_run['world']}, compression warm-up {cfg['compression_warmup']} steps.")
    print(f"Load average before: {args.load_before}; after: {args.load_after} (2 cores, shared with other jobs).")
    rounds = sorted({r for by_round in runs.values() for r in by_round})
    print(f"{len(rounds)} rounds, the modes interleaved (order rotated every round). Step time: median of each "
          f"run's steps {args.skip}..{cfg['steps'] - 1} (rank 0's step: data, forward, backward with the gradient "
          "sync, optimizer, loss all-reduce), then median [min, max] over the rounds.\n")
    print("| mode | step ms, median [min, max] | x faster than none, median [min, max] | loss at last step | "
          f"vs none | mean loss, last 10 steps | vs none | choice per {'unit' if engine == 'fsdp' else 'bucket'} |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for mode in modes:
        by_round = runs[key[mode]]
        med = {r: statistics.median(run["step_seconds"][args.skip:]) * 1e3 for r, run in by_round.items()}
        times = sorted(med.values())
        speed = ""
        if base is not None:
            ratios = sorted(statistics.median(base[r]["step_seconds"][args.skip:]) * 1e3 / med[r]
                            for r in med if r in base)
            speed = f"{statistics.median(ratios):.2f} [{ratios[0]:.2f}, {ratios[-1]:.2f}]"
        first = by_round[min(by_round)]
        losses = [run["losses"][-1] for run in by_round.values()]
        same = "" if len(set(losses)) == 1 else " (differs between rounds!)"
        last, last10 = first["losses"][-1], float(np.mean(first["losses"][-10:]))
        rel = rel10 = ""
        if base is not None:
            b = base[min(base)]["losses"]
            rel = f"{100 * (last / b[-1] - 1):+.2f} %"
            rel10 = f"{100 * (last10 / np.mean(b[-10:]) - 1):+.2f} %"
        choice = ", ".join(first.get("compression_choices") or []) or "-"
        print(f"| {mode} | {statistics.median(times):.1f} [{times[0]:.1f}, {times[-1]:.1f}] | {speed} | "
              f"{last:.8f}{same} | {rel} | {last10:.8f} | {rel10} | {choice} |")


if __name__ == "__main__":
    main()
