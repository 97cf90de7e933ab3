"""A non-blocking all-reduce waited on at once against the blocking one: what the progress thread adds.

    OMP_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/progress_wait.py
    MPIR_CVAR_CH4_CMA_ENABLE=0 OMP_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/progress_wait.py

``comm.allreduce(buf)`` and ``comm.iallreduce(buf).wait()`` of ``--mib`` MiB float32, interleaved call by call after
a barrier, ``--iters`` times (the first ``--warmup`` dropped); rank 0 prints each one's median and their ratio. The
non-blocking one runs on the communicator's progress thread, whose waits sleep between polls so that the caller's
compute keeps its core, except while a thread waits for the result (mpcomm.transport.Waiters). Where MPI moves a
large message only during its calls (MPICH without CMA, e.g. yama's ``ptrace_scope`` not 0) each such sleep holds
the copy up.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from mpcomm import Communicator


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=4.0)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    comm = Communicator()
    buf = np.ones(int(args.mib * (1 << 20)) // 4, dtype=np.float32)
    ways = {"blocking allreduce": lambda: comm.allreduce(buf),
            "iallreduce + wait": lambda: comm.iallreduce(buf).wait()}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.iters):
        for name, call in ways.items():
            comm.barrier()
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    if comm.rank == 0:
        medians = {name: float(np.median(ts[args.warmup:])) * 1e3 for name, ts in times.items()}
        print(f"p = {comm.size}, {args.mib:g} MiB float32, medians of {args.iters - args.warmup} calls: "
              + ", ".join(f"{name} {ms:.2f} ms" for name, ms in medians.items())
              + f"; ratio {medians['iallreduce + wait'] / medians['blocking allreduce']:.2f}")
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
