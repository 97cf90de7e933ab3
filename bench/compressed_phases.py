"""Where the time of ``allreduce(wire=...)`` goes on the simulated cluster, and what its pipeline's segment buys.

Without ``--segment-mib``: the phases the timeline records (``comm.timeline``) over REPEATS calls per wire, with the
whole call (the pipeline's steps interleave: a phase's time is its total over the segments, waits included). With ``--segment-mib A B ...``: whole calls with ``compressed.SEGMENT_BYTES`` set to each size in turn,
round-robin (every size sees the same load), REPEATS rounds; a segment as large as the vector runs the phases one
after another (no overlap), the algorithm as it was before the pipeline. One line each:

    ci/cluster.sh 2 2 1gbit -- mpiexec -n 4 python bench/compressed_phases.py [--mib 64] [--repeats 5]
    ci/cluster.sh 2 2 1gbit -- mpiexec -n 4 python bench/compressed_phases.py --segment-mib 4 8 16 64 --repeats 9

Prints per wire (and segment) the median, min and max of the slowest rank's call time (ms), and per phase the
slowest rank's time in it per call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms import compressed


def phase_times(path: str, calls: int) -> dict[str, float]:
    """Per phase name: the slowest rank's time in it per call (ms; a phase that runs once per pipeline segment
    summed over the segments), in the order the phases first ran."""
    with open(path) as f:
        events = sorted((e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])
    totals: dict[str, dict[int, float]] = {}
    for e in events:
        per_rank = totals.setdefault(e["name"], {})
        per_rank[e["pid"]] = per_rank.get(e["pid"], 0.0) + e["dur"] / 1e3
    return {name: max(per_rank.values()) / calls for name, per_rank in totals.items()}


def timed(comm: Communicator, buf: np.ndarray, x: np.ndarray, wire: str) -> float:
    """One call's time on the slowest rank (ms), from a common start."""
    np.copyto(buf, x)
    comm.barrier()
    start = time.perf_counter()
    comm.allreduce(buf, wire=wire)
    return comm.allreduce(np.array([time.perf_counter() - start]), op="max")[0] * 1e3


def summary(times: list[float]) -> str:
    return f"median {statistics.median(times):7.1f} ms (min {min(times):.1f}, max {max(times):.1f}, {len(times)} calls)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wires", default="bf16,int8")
    parser.add_argument("--segment-mib", type=float, nargs="*", default=[])
    args = parser.parse_args()
    comm = Communicator(MPI.COMM_WORLD)
    n = int(args.mib * 2**20) // 4
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    buf = np.empty_like(x)
    where = f"{args.mib:g} MiB on {comm.size} ranks"
    for wire in args.wires.split(","):
        timed(comm, buf, x, wire)  # warm-up: scratch buffers, connections
        if args.segment_mib:
            times: dict[float, list[float]] = {mib: [] for mib in args.segment_mib}
            for _ in range(args.repeats):
                for mib in args.segment_mib:
                    compressed.SEGMENT_BYTES = int(mib * 2**20)
                    times[mib].append(timed(comm, buf, x, wire))
            if comm.rank == 0:
                for mib, values in times.items():
                    print(f"{wire} segments of {mib:g} MiB, {where}: {summary(values)}", flush=True)
            continue
        path = os.path.join(tempfile.gettempdir(), f"compressed_phases_{os.getppid()}.json")
        with comm.timeline(path):
            whole = [timed(comm, buf, x, wire) for _ in range(args.repeats)]
        if comm.rank == 0:
            print(f"{wire}, {where}: whole call {summary(whole)}")
            for name, ms in phase_times(path, args.repeats).items():
                if not name.startswith(("allreduce", "barrier")):
                    print(f"    {name:40s} {ms:8.1f} ms", flush=True)
    comm.free()


if __name__ == "__main__":
    main()
