"""Print which MPI, mpi4py, numpy and CUDA-awareness this process sees (the header of every test log)."""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI, __version__ as mpi4py_version

from . import native_calls
from .mpi_library import library


def describe() -> str:
    name = MPI.Get_library_version().splitlines()[0].strip()
    thread = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}[MPI.Query_thread()]
    calls = "C" if native_calls.load() is not None else "mpi4py"  # (builds it on first use)
    ops = "mpcomm's" if native_calls.reduction_ops() and library().min_max_op else "MPI's, with passes"
    deadline = "a watchdog (ULFM)" if native_calls.fault_tolerant() else "polled requests"
    return (f"mpcomm on {name} | MPI {'.'.join(map(str, MPI.Get_version()))} | thread level {thread} | "
            f"native's small all-reduce: {calls} | native's deadline: {deadline} | "
            f"native's float ops on one node: {ops} | "
            f"mpi4py {mpi4py_version} | numpy {np.__version__} | python {sys.version.split()[0]}")


if __name__ == "__main__":
    print(describe())
