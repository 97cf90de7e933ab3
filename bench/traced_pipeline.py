"""A two-stage pipeline trained step by step with the executor's trace on: the run that bench/pipeline_handoff.py
and bench/pipeline_idle.py read their figures from."""
from __future__ import annotations

from typing import Iterator

from mpi4py import MPI

from glibc_malloc import keep_freed_memory  # bench/glibc_malloc.py
from mpcomm import Communicator
from mpcomm.nn import SGD
from mpcomm.parallel.pipeline import PipelineParallel


def two_ranks() -> Communicator:
    """The world as a Communicator of exactly two ranks (one per stage), glibc keeping freed memory."""
    keep_freed_memory()
    comm = Communicator(MPI.COMM_WORLD, timeout=120)
    if comm.size != 2:
        raise SystemExit("run with mpiexec -n 2 (one rank per pipeline stage)")
    return comm


def traced_steps(pipe: PipelineParallel, x, y, steps: int, warmup: int) -> Iterator[int]:
    """Train ``warmup + steps`` SGD steps; after each of the last ``steps`` yield with ``pipe.trace`` holding it."""
    opt = SGD(pipe.parameters(), lr=1e-4)
    for step in range(warmup + steps):
        pipe.comm.barrier()
        pipe.trace = []
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()
        if step >= warmup:
            yield step
