"""Large all-reduces on 4 KiB pages against huge pages, per algorithm: what torch's default tensors cost.

    OMP_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/experiments/page_size.py

torch allocates CPU tensors on 4 KiB pages unless ``THP_MEM_ALLOC_ENABLE=1`` is set before it starts; numpy asks
the kernel for transparent huge pages for large arrays. The same ``Communicator.allreduce`` runs on a torch tensor's
memory (``tensor.numpy()``, no copy) and on a numpy array of the same size, for auto and every algorithm,
interleaved over ``--rounds`` rounds of ``--calls`` calls; busbw = size x 2(p-1)/p / time of the slowest rank,
median over the rounds.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from mpi4py import MPI

from mpcomm import Communicator

ALGORITHMS = ("auto", "native", "ring", "rhd", "ring_pipelined")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args(argv)
    comm = Communicator(MPI.COMM_WORLD)
    p = comm.size
    if comm.rank == 0:
        print(f"{p} ranks; busbw GB/s, median of {args.rounds} rounds of {args.calls} calls")
        print("| size | algorithm | 4 KiB pages (torch tensor) | huge pages (numpy array) | 4 KiB / huge |")
        print("|---:|---|---:|---:|---:|")
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        count = mib * 2**20 // 4
        buffers = {"4k": torch.ones(count).numpy(), "huge": np.ones(count, np.float32)}
        seconds: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for algorithm in ALGORITHMS:
                for pages, array in buffers.items():
                    comm.barrier()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        comm.allreduce(array, algorithm=algorithm)
                    elapsed = np.array([(time.perf_counter() - start) / args.calls])
                    comm.allreduce(elapsed, op="max")
                    seconds.setdefault((algorithm, pages), []).append(float(elapsed[0]))
        if comm.rank == 0:
            factor = mib * 2**20 * 2 * (p - 1) / p / 1e9
            chosen = comm.selector.choose("allreduce", count * 4, np.float32)
            for algorithm in ALGORITHMS:
                small, huge = (factor / np.median(seconds[(algorithm, pages)]) for pages in ("4k", "huge"))
                name = f"auto ({chosen})" if algorithm == "auto" else algorithm
                print(f"| {mib} MiB | {name} | {small:.2f} | {huge:.2f} | {small / huge:.2f} |")
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
