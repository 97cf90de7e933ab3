"""The flight recorder's cost on the 8-byte all-reduce: the same call on a Communicator that records and on one
that does not (``MPCOMM_TRACE_BUFFER=0``), in one job.

``mpiexec -n P python bench/trace_cost.py [--calls 500] [--pairs 400] [--timeline] [--json FILE]``

``--timeline``: instead, the recording Communicator with a timeline recording (``comm.timeline``) against the same
Communicator without one (the timeline is switched on and off between loops; its spans are dropped after each).
``--straggler SECONDS``: instead, a Communicator with straggler detection (``MPCOMM_STRAGGLER``) against the
recording one without it.

The two loops of ``--calls`` calls alternate, in the order flipped every pair, ``--pairs`` times, so load that
comes and goes hits both alike; a loop's time is the slowest rank's. Printed: each side's minimum, 10th
percentile and median loop (us per call) and their differences — the recorder's cost — and the median and
quartiles of the pairs' differences. Load only adds time to a loop, so on a busy machine the minimum and the
10th percentile are the steadier figures.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
from mpi4py import MPI
from small_messages import communicator_with, time_loop, untraced_communicator

from mpcomm import Communicator


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500, help="calls per timed loop")
    parser.add_argument("--pairs", type=int, default=400, help="pairs of loops (recording, not recording)")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--timeline", action="store_true", help="the cost of a timeline recording instead")
    parser.add_argument("--straggler", type=float, default=0.0, help="the cost of straggler detection instead")
    parser.add_argument("--json", help="write the result here (rank 0)")
    args = parser.parse_args(argv)
    traced, untraced = Communicator(MPI.COMM_WORLD), untraced_communicator()
    world, buf = traced.mpi, np.ones(2, dtype=np.float32)
    calls = {"recording": lambda: traced.allreduce(buf, algorithm=args.algorithm),
             "off": lambda: untraced.allreduce(buf, algorithm=args.algorithm)}
    if args.straggler:
        detecting = communicator_with("MPCOMM_STRAGGLER", str(args.straggler))
        calls = {"recording": lambda: detecting.allreduce(buf, algorithm=args.algorithm), "off": calls["recording"]}
    switch = {name: lambda: None for name in calls}  # run before each loop, untimed
    if args.timeline:  # the same call, with the timeline following the lanes or not
        timeline = traced.timeline(os.path.join(tempfile.gettempdir(), f"trace_cost_timeline_{os.getpid()}.json"))
        calls = {"recording": calls["recording"], "off": calls["recording"]}
        switch = {"recording": lambda: (timeline.calls.clear(), timeline.recorder.follow(timeline)),
                  "off": lambda: timeline.recorder.follow(None)}
    for name, call in calls.items():  # warm-up: plans, MPI's lazy set-up
        switch[name]()
        for _ in range(2000):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for pair in range(args.pairs):
        for name in (("recording", "off") if pair % 2 else ("off", "recording")):
            switch[name]()
            times[name].append(time_loop(world, calls[name], args.calls))
    cost = np.subtract(times["recording"], times["off"])
    quartiles = np.percentile(cost, [25, 50, 75])
    stats = {name: {"min": float(np.min(t)), "p10": float(np.percentile(t, 10)), "median": float(np.median(t))}
             for name, t in times.items()}
    result = {"ranks": traced.size, "calls": args.calls, "pairs": args.pairs, "algorithm": args.algorithm,
              "compared": ("timeline on - off" if args.timeline else "straggler detection on - off" if args.straggler
                           else "recorder on - off"),
              "cost_us_paired_median": float(quartiles[1]), "cost_us_paired_q1": float(quartiles[0]),
              "cost_us_paired_q3": float(quartiles[2]), "us_per_call": stats,
              **{f"cost_us_{stat}": stats["recording"][stat] - stats["off"][stat] for stat in ("min", "p10", "median")}}
    if traced.rank == 0:
        print(f"{traced.size} ranks, 8 B all-reduce ({args.algorithm}), {args.pairs} pairs of {args.calls}-call loops; "
              "us per call")
        for name, s in stats.items():
            print(f"  {name:10} min {s['min']:7.3f}  p10 {s['p10']:7.3f}  median {s['median']:7.3f}")
        print(f"  {result['compared']}: cost min {result['cost_us_min']:+.3f}  "
              f"p10 {result['cost_us_p10']:+.3f}  median {result['cost_us_median']:+.3f}; "
              f"paired differences: median {quartiles[1]:+.3f} "
              f"[quartiles {quartiles[0]:+.3f} .. {quartiles[2]:+.3f}]")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if args.timeline:
        timeline.stop()
    if args.straggler:
        detecting.free()
    untraced.free()
    traced.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
