"""The shared driver: size sweep, warm-up, timing, correctness check and rows, for every collective.

Timing follows nccl-tests within a block: a barrier before it, back-to-back calls, the per-call time of a
rank is the mean over the block, and the block's time is the maximum over ranks.  The algorithms of one point
are timed in ``rounds`` round-robin blocks and each reports its median block, so load drift on a shared machine
hits every algorithm alike (``rounds=1`` is exactly nccl-tests).
``iters`` is an upper bound: a warm-up measures the per-call time (maximum over ranks, so every rank
agrees) and the block is shortened to fit ``budget`` seconds, at least one call, so large sizes stay quick.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import numpy as np
from mpi4py import MPI

from .all_gather import AllGather
from .allreduce import AllReduce
from .base import Collective
from .broadcast import Broadcast
from .reduce_scatter import ReduceScatter
from .sendrecv import SendRecv

COLLECTIVES: dict[str, type[Collective]] = {
    c.name: c for c in (AllReduce, ReduceScatter, AllGather, Broadcast, SendRecv)
}

GB = 1e9


def busbw_factor(operation: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: allreduce 2(p-1)/p, reduce_scatter/all_gather (p-1)/p, others 1."""
    return COLLECTIVES[operation].busbw_factor(p)


def sizes(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """minbytes, minbytes*factor, ... below maxbytes, then maxbytes itself."""
    out, size = [], minbytes
    while size < maxbytes:
        out.append(size)
        size *= factor
    out.append(maxbytes)
    return out


@dataclass
class Plan:
    """Everything the sweep needs, already validated (the CLI builds it from argv)."""

    operation: str
    algorithms: list[str]
    sizes: list[int]
    combos: list[tuple[np.dtype, str]]   # (dtype, redop) pairs; redop "none" for non-reducing operations
    warmup: int = 5
    iters: int = 20
    budget: float = 1.0
    rounds: int = 3
    check: bool = False
    root: int = 0
    seed: int = 1234
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rounds = max(1, min(self.rounds, self.iters))  # -n stays the most timed calls in all


@dataclass
class Timing:
    seconds: float
    iters: int
    warmup: int


def time_calls(step: Callable[[], None], world: MPI.Comm, warmup: int, iters: int, budget: float) -> Timing:
    """Max over ranks of the mean per-call time of ``step``, after warm-up, within about ``budget`` seconds."""
    world.Barrier()
    done_warmup = 0
    if warmup > 0:
        start = MPI.Wtime()
        step()
        first = world.allreduce(MPI.Wtime() - start, op=MPI.MAX)
        done_warmup, estimate = 1, first
        more = min(warmup - 1, int(0.5 * budget / first) if first > 0 else warmup - 1)
        if more > 0:
            world.Barrier()
            start = MPI.Wtime()
            for _ in range(more):
                step()
            estimate = world.allreduce((MPI.Wtime() - start) / more, op=MPI.MAX)
            done_warmup += more
        if estimate > 0:
            iters = max(1, min(iters, int(budget / estimate)))
    world.Barrier()
    start = MPI.Wtime()
    for _ in range(iters):
        step()
    mean = (MPI.Wtime() - start) / iters
    return Timing(world.allreduce(mean, op=MPI.MAX), iters, done_warmup)


def memcpy_bandwidth(nbytes: int, world: MPI.Comm, budget: float = 0.05, reps: int = 20) -> float:
    """GB/s of a numpy copy of ``nbytes`` on rank 0 (best of up to ``reps`` copies within about ``budget``
    seconds, at least 3): the intra-node physical ceiling a shared-memory collective cannot beat."""
    rate = 0.0
    if world.Get_rank() == 0:
        src = np.ones(max(nbytes, 1), dtype=np.uint8)
        dst = np.empty_like(src)
        np.copyto(dst, src)  # touch the pages
        best, spent = float("inf"), 0.0
        for i in range(reps):
            start = time.perf_counter()
            np.copyto(dst, src)
            elapsed = time.perf_counter() - start
            best, spent = min(best, elapsed), spent + elapsed
            if i >= 2 and spent > budget:
                break
        rate = src.nbytes / best / GB if best > 0 else float("inf")
    return world.bcast(rate, root=0)


def resolved_algorithm(comm, operation: str, nbytes: int, dtype) -> str | None:
    """What "auto" picks for this call, where the selector says so (None otherwise)."""
    selector = getattr(comm, "selector", None)
    try:
        return str(selector.choose(operation, nbytes, np.dtype(dtype)))
    except Exception:  # noqa: BLE001 - informative only; a selector with another interface is fine
        return None


def sweep(comm, plan: Plan, on_rows: Callable[[list[dict]], None] | None = None,
          progress: Callable[[int, int, str], None] | None = None) -> list[dict]:
    """Run every (size, dtype, redop, algorithm) point of ``plan``; returns the rows (identical on every rank).

    "native" is always timed first at each point when the operation has one, so ``vs_native`` (native time
    divided by this algorithm's time, > 1 = faster than native) is known for every row.
    """
    cls = COLLECTIVES[plan.operation]
    world, p = comm.mpi, comm.size
    order = (["native"] if "native" in cls.algorithms() else []) + [a for a in plan.algorithms if a != "native"]
    shown = plan.algorithms if "native" in plan.algorithms or "native" not in order else ["native"] + plan.algorithms
    total = len(plan.sizes) * len(plan.combos) * len(order)
    rows: list[dict] = []
    done = 0
    for dtype, redop in plan.combos:
        seen: set[int] = set()
        for requested in plan.sizes:
            count, size = cls.layout(requested, dtype.itemsize, p)
            if size in seen:  # several requested sizes can round to the same element count
                continue
            seen.add(size)
            case = cls(comm, count, dtype, redop if cls.reduces else "sum", plan.root, plan.seed)
            results: dict[str, dict] = {}
            try:
                timings = _interleaved_timings(case, order, world, plan)
                for algorithm in order:
                    if progress is not None:
                        progress(done, total, f"{plan.operation} {size} B {dtype} {redop} {algorithm}")
                    wrong, identical = case.check(algorithm) if plan.check else (None, None)
                    results[algorithm] = _row(plan, cls, comm, size, count, dtype, redop, algorithm,
                                              timings[algorithm], wrong, identical)
                    done += 1
            finally:
                case.close()
            native = results.get("native")
            block = []
            for algorithm in shown:
                row = results[algorithm]
                row["vs_native"] = (native["time_us"] / row["time_us"]) if native and row["time_us"] > 0 else None
                block.append(row)
            rows.extend(block)
            if on_rows is not None:
                on_rows(block)
    return rows


def _interleaved_timings(case, algorithms: list[str], world: MPI.Comm, plan: Plan) -> dict[str, Timing]:
    """Time every algorithm of one point in ``plan.rounds`` round-robin rounds; per algorithm the median round.

    Each round is an nccl-tests block (:func:`time_calls`) with ``budget / rounds`` seconds; the first round
    warms up and fixes the block length the later rounds reuse (after one or two untimed calls each); each
    round starts one algorithm later than the one before.  Round-robin puts every algorithm under the
    same load drift of a shared machine, so two algorithms that are really equal also measure equal.
    """
    rounds = plan.rounds
    blocks: dict[str, list[Timing]] = {a: [] for a in algorithms}
    for r in range(rounds):
        shift = r % len(algorithms)  # rotate the order, so no algorithm always follows the same one
        for algorithm in algorithms[shift:] + algorithms[:shift]:
            def step(algorithm=algorithm):
                case.step(algorithm)
            if r == 0:
                timing = time_calls(step, world, plan.warmup, plan.iters // rounds, plan.budget / rounds)
            else:
                # a call or two untimed first: the algorithm before it in the round left other code in the caches
                warmup, iters = min(plan.warmup, 2), blocks[algorithm][0].iters
                timing = time_calls(step, world, warmup, iters, plan.budget / rounds)
            blocks[algorithm].append(timing)
    return {a: Timing(float(np.median([t.seconds for t in ts])), sum(t.iters for t in ts), ts[0].warmup)
            for a, ts in blocks.items()}


def _row(plan, cls, comm, size, count, dtype, redop, algorithm, timing: Timing, wrong, identical) -> dict:
    seconds = timing.seconds
    algbw = size / seconds / GB if seconds > 0 else 0.0
    return {
        "collective": plan.operation,
        "size": size,
        "count": count,
        "dtype": str(dtype),
        "op": redop,
        "redop": redop,
        "root": plan.root if plan.operation == "broadcast" else None,
        "algorithm": algorithm,
        "resolved": resolved_algorithm(comm, plan.operation, size, dtype) if algorithm == "auto" else algorithm,
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": algbw * cls.busbw_factor(comm.size),
        "wrong": wrong,
        "identical": identical,
        "vs_native": None,
        "iters": timing.iters,
        "warmup": timing.warmup,
        "ranks": comm.size,
        "nodes": getattr(comm, "num_nodes", None),
    }


def tty_progress(stream: TextIO = sys.stderr) -> Callable[[int, int, str], None] | None:
    """A one-line progress display on ``stream`` when it is a terminal, else None."""
    if not getattr(stream, "isatty", lambda: False)():
        return None

    def show(done: int, total: int, what: str) -> None:
        stream.write(f"\r\033[K[{done + 1}/{total}] {what}")
        stream.flush()

    return show
