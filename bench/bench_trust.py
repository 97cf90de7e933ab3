"""Can mpcomm-bench's default small-message numbers be trusted? One job, interleaved:

    timeout 600 mpiexec -n P python bench/bench_trust.py [--repeat 3] [--calls 3000] [--size 8]

Each repeat measures, in this order, a long loop of ``--calls`` back-to-back ``comm.allreduce(8 B,
algorithm="native")`` after a barrier (the max over ranks of the mean per call, as the driver computes it), then
``mpcomm-bench`` with its default timing settings at that one size (``-b 8 -e 8``, every algorithm, so native is
timed round-robin with the others as in a default run), then the loop again; it prints the loops, the driver's
native row and driver / (mean of the two loops) (issue target: <= 1.25; the loops bracket the driver so that
load drift during the repeat cancels). A raw ``MPI.Comm.Allreduce`` loop and the driver's ``mpi4py-raw`` row
are printed beside them. The last line gives the median and the range of the ratios over the repeats: the
spread is the VM's noise.
"""
from __future__ import annotations

import argparse
import io
import os
import statistics

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.bench import run
from mpcomm.bench.base import RAW


def loop_us(call, world: MPI.Comm, calls: int, warmup: int = 100) -> float:
    """µs per call of ``calls`` back-to-back calls after a barrier, the max over ranks."""
    for _ in range(warmup):
        call()
    world.Barrier()
    start = MPI.Wtime()
    for _ in range(calls):
        call()
    return world.allreduce(MPI.Wtime() - start, op=MPI.MAX) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="interleaved (loop, driver) pairs (default 3)")
    parser.add_argument("--calls", type=int, default=3000, help="calls in the long loop (default 3000)")
    parser.add_argument("--size", type=int, default=8, help="bytes of float32 (default 8)")
    args = parser.parse_args()

    world = MPI.COMM_WORLD
    comm = Communicator(world)
    leader = world.Get_rank() == 0
    buf = np.zeros(max(1, args.size // 4), np.float32)  # zeros: any number of sums stays finite
    raw_comm = world.Dup()
    if leader:
        print(f"# bench_trust: p = {world.Get_size()}, {buf.nbytes} B float32 sum, loops of {args.calls} calls, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
        print(f"# {'repeat':>6} {'loop native':>17} {'driver native':>14} {'ratio':>6}   "
              f"{'loop raw':>9} {'driver raw':>11}   (µs per call; loops before / after the driver)")

    def native():
        comm.allreduce(buf, algorithm="native")

    def raw():
        raw_comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)

    ratios = []
    for repeat in range(args.repeat):
        before = loop_us(native, world, args.calls)
        loop_raw = loop_us(raw, world, args.calls)
        rows = run(["-b", str(buf.nbytes), "-e", str(buf.nbytes)], comm=comm, out=io.StringIO())
        after = loop_us(native, world, args.calls)
        driver = {r["algorithm"]: r for r in rows}
        ratio = driver["native"]["time_us"] / ((before + after) / 2)
        ratios.append(ratio)
        if leader:
            print(f"  {repeat:>6} {before:>8.2f} {after:>8.2f} {driver['native']['time_us']:>14.2f} {ratio:>6.2f}   "
                  f"{loop_raw:>9.2f} {driver[RAW]['time_us']:>11.2f}   "
                  f"(driver blocks of {driver['native']['block']} calls)", flush=True)
    if leader:
        print(f"# driver native / {args.calls}-call loop: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} repeats (target <= 1.25)")
    raw_comm.Free()
    comm.free()


if __name__ == "__main__":
    main()
