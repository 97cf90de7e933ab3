"""Calibration: time every algorithm on the live communicator and build the table ``auto`` chooses from.

For each operation and message size the candidate algorithms run round-robin, ``repeats`` rounds after a
warm-up, each round a barrier then a block of calls of about 5 ms; a rank's time for an algorithm is
the median of its rounds' per-call times and the time of the
algorithm is the largest over the ranks (the collective is as slow as its slowest rank). Rank 0 picks the
fastest algorithm per size, fits ``seconds = alpha + beta * bytes`` per algorithm by least squares, and
broadcasts the table, so every rank holds the same one. The table is plain JSON::

    {"format": "mpcomm-tuning/1", "layout": {"size": 4, "node_sizes": [2, 2]}, "mpi": "MPICH Version: ...",
     "operations": {"allreduce": {"float32": {"sizes": [...], "best": [...],
                                               "seconds": {"ring": [...], ...},
                                               "fit": {"ring": {"alpha": s, "beta": s_per_byte}, ...}}}}}

Every operation with an algorithm choice can be tuned (``operations=``: allreduce, reduce_scatter, all_gather,
broadcast, reduce, gather, scatter, all_to_all, all_to_all_v); a size is the byte count ``Communicator`` asks
``auto`` about for that operation: the vector (allreduce, broadcast, reduce), the whole buffer of p blocks
(reduce_scatter, all_gather, gather, scatter) or one rank's send buffer of p blocks (all-to-all; all_to_all_v is
timed with equal counts). Sizes that round to the same element counts are measured once.

The table's format and its checks are :mod:`mpcomm.tuning.table`; the command line is :mod:`mpcomm.tuning.cli`.
"""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..algorithms import REGISTRY
from .table import TABLE_FORMAT

DEFAULT_SIZES = tuple(8 << (3 * k) for k in range(8))  # 8 B, 64 B, ..., 16 MiB


def tune(comm, sizes=DEFAULT_SIZES, repeats: int = 5, operations=("allreduce",), dtype="float32",
         algorithms=None, verbose: bool = True) -> dict:
    """Measure, decide on rank 0, broadcast; returns the table (``comm.selector`` is not changed here)."""
    dtype = np.dtype(dtype)
    sizes = sorted({int(s) for s in sizes})
    _check(comm, sizes, repeats, operations, algorithms)
    table = {
        "format": TABLE_FORMAT,
        "layout": comm.selector.layout.to_json(),
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "operations": {},
    }
    for operation in operations:
        names = [a for a in REGISTRY[operation] if algorithms is None or a in algorithms]
        per_rank = sorted({_count(operation, s, dtype, comm.size) for s in sizes})
        nbytes = [count * dtype.itemsize * _factor(operation, comm.size) for count in per_rank]
        seconds = np.array([_median_times(comm, operation, names, n, dtype, repeats) for n in nbytes]).T
        comm.allreduce(seconds, op="max", algorithm="native")
        entry = _decide(names, nbytes, seconds) if comm.rank == 0 else None
        table["operations"][operation] = {str(dtype): comm.bcast_object(entry, root=0, operation="tune")}
    if verbose and comm.rank == 0:
        print(describe(table), flush=True)
    return table


def describe(table: dict) -> str:
    """The measured times, the choice per size and the alpha/beta fits, as text."""
    layout = table["layout"]
    lines = [f"mpcomm tune: {layout['size']} ranks on nodes of {layout['node_sizes']} ({table['mpi']})"]
    for operation, by_dtype in table["operations"].items():
        for dtype, entry in by_dtype.items():
            names = list(entry["seconds"])
            lines.append(f"{operation} {dtype}: median time in us (max over ranks)")
            lines.append(f"{'bytes':>10} " + " ".join(f"{a:>14}" for a in names) + "  best")
            for i, n in enumerate(entry["sizes"]):
                row = " ".join(f"{entry['seconds'][a][i] * 1e6:14.1f}" for a in names)
                lines.append(f"{n:>10} {row}  {entry['best'][i]}")
            for a, fit in entry["fit"].items():
                rate = f"{1 / fit['beta'] / 1e9:.2f} GB/s" if fit["beta"] > 0 else "n/a"
                lines.append(f"  fit {a:>14}: alpha = {fit['alpha'] * 1e6:9.1f} us, beta = "
                             f"{fit['beta'] * 1e9:.4f} ns/B (1/beta = {rate})")
    return "\n".join(lines)


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least-squares ``seconds ~ alpha + beta * bytes``."""
    design = np.column_stack([np.ones(len(nbytes)), np.asarray(nbytes, dtype=float)])
    (alpha, beta), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=float), rcond=None)
    return float(alpha), float(beta)


# ------------------------------------------------------------------ internals
def _decide(names, nbytes, seconds) -> dict:
    return {
        "sizes": list(nbytes),
        "best": [names[i] for i in seconds.argmin(axis=0)],
        "seconds": {a: seconds[j].tolist() for j, a in enumerate(names)},
        "fit": {a: dict(zip(("alpha", "beta"), fit_alpha_beta(nbytes, seconds[j]))) for j, a in enumerate(names)},
    }


def _check(comm, sizes, repeats, operations, algorithms) -> None:
    if not sizes or sizes[0] < 1:
        raise ValueError(f"tune: sizes must be positive byte counts, got {sizes}")
    if not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise ValueError(f"tune: repeats must be a positive integer, got {repeats!r}")
    if isinstance(operations, str):
        raise ValueError(f"tune: operations must be a sequence of names, e.g. ({operations!r},)")
    for operation in operations:
        if operation not in REGISTRY:
            raise ValueError(f"tune: unknown operation {operation!r}; choose from {sorted(REGISTRY)}")
    known = set().union(*(REGISTRY[o] for o in operations))
    if algorithms is not None and not set(algorithms) <= known:
        raise ValueError(f"tune: unknown algorithm(s) {sorted(set(algorithms) - known)}; known: {sorted(known)}")


# The operations whose selector bytes are p blocks: the whole buffer (Communicator.plan plans these on one
# rank's block and asks about size times its bytes) or, for all-to-all, one rank's send buffer of p blocks.
_BLOCKS = ("reduce_scatter", "all_gather", "gather", "scatter", "all_to_all", "all_to_all_v")


def _factor(operation: str, size: int) -> int:
    """How many per-rank counts make up the message bytes the selector is asked about."""
    return size if operation in _BLOCKS else 1


def _count(operation: str, nbytes: int, dtype: np.dtype, size: int) -> int:
    return max(1, nbytes // dtype.itemsize // _factor(operation, size))


def _runner(comm, operation: str, algorithm: str, nbytes: int, dtype: np.dtype):
    """One call of ``operation`` with ``algorithm`` on zeros whose selector bytes are ``nbytes`` (root 0)."""
    count = nbytes // dtype.itemsize // _factor(operation, comm.size)
    op = "max" if dtype == np.bool_ else "sum"
    p, on_root = comm.size, comm.rank == 0

    def zeros(n: int, here: bool = True):
        return np.zeros(n, dtype) if here else None  # None: a buffer only the root uses

    if operation == "allreduce":
        buf = zeros(count)
        return lambda: comm.allreduce(buf, op=op, algorithm=algorithm)
    if operation == "reduce_scatter":
        send, recv = zeros(count * p), zeros(count)
        return lambda: comm.reduce_scatter(send, recv, op=op, algorithm=algorithm)
    if operation == "all_gather":
        send, recv = zeros(count), zeros(count * p)
        return lambda: comm.all_gather(send, recv, algorithm=algorithm)
    if operation == "broadcast":
        buf = zeros(count)
        return lambda: comm.broadcast(buf, root=0, algorithm=algorithm)
    if operation == "reduce":
        send, recv = zeros(count), zeros(count, on_root)
        return lambda: comm.reduce(send, recv, op=op, root=0, algorithm=algorithm)
    if operation == "gather":
        send, recv = zeros(count), zeros(count * p, on_root)
        return lambda: comm.gather(send, recv, root=0, algorithm=algorithm)
    if operation == "scatter":
        send, recv = zeros(count * p, on_root), zeros(count)
        return lambda: comm.scatter(send, recv, root=0, algorithm=algorithm)
    if operation == "all_to_all":
        send, recv = zeros(count * p), zeros(count * p)
        return lambda: comm.all_to_all(send, recv, algorithm=algorithm)
    if operation == "all_to_all_v":
        send, recv, counts = zeros(count * p), zeros(count * p), [count] * p
        return lambda: comm.all_to_all_v(send, counts, recv, counts, algorithm=algorithm)
    raise NotImplementedError(f"tune: mpcomm.tuning cannot time {operation!r} yet (registered in REGISTRY, but "
                              "_runner has no call for it)")


def _median_times(comm, operation, algorithms, nbytes, dtype, repeats, block_seconds: float = 5e-3) -> list[float]:
    """Per algorithm, this rank's median per-call time. The algorithms run round-robin, ``repeats`` rounds, so
    load drift on a shared machine hits them alike; each round times a block of calls lasting about
    ``block_seconds`` (at least one call; the same count on every rank), which steadies small messages."""
    runs = [_runner(comm, operation, a, nbytes, dtype) for a in algorithms]
    calls = []
    for run in runs:
        run()  # warm-up: scratch buffers, sub-communicators
        comm.barrier()
        start = time.perf_counter()
        run()
        once = np.array([time.perf_counter() - start])
        comm.allreduce(once, op="max", algorithm="native")
        calls.append(int(min(50, max(1, block_seconds // max(once[0], 1e-9)))))
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, count, samples in zip(runs, calls, times):
            comm.barrier()
            start = time.perf_counter()
            for _ in range(count):
                run()
            samples.append((time.perf_counter() - start) / count)
    return [float(np.median(samples)) for samples in times]
