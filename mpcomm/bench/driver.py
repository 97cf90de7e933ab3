"""The shared driver: size sweep, warm-up, timing, correctness check and rows, for every collective.

Timing follows nccl-tests within a block: a barrier before it, back-to-back calls, the per-call time of a
rank is the mean over the block, and the block's time is the maximum over ranks.  The algorithms of one point
are timed in ``rounds`` round-robin blocks and each reports its median block, so load drift on a shared machine
hits every algorithm alike (``rounds=1`` is one nccl-tests block).

How long a block is (``-n``, ``--budget``, ``--rounds``, ``-w``): a block must be long next to the skew with
which ranks leave the barrier (tens of µs here, more when ranks share cores), or small messages measure the
barrier.  So a block lasts :data:`BLOCK_SECONDS` (10 ms) or ``iters`` calls (``-n``, default 1000), whichever
comes first, and never more than ``budget / rounds`` seconds (``--budget`` is per algorithm and point), nor
fewer than one call.  The length is calibrated once per algorithm and point, in the first round: trial blocks
of 1, 4, 16, ... calls (they are the warm-up; at least ``warmup`` calls) until one lasts
:data:`CALIBRATION_SECONDS` (1 ms: long enough that the skew no longer inflates its per-call time) or reaches
``iters`` calls; trials stop early at half the block's budget.  Later rounds reuse the length after one or two
untimed calls.  With the defaults an 8 B all-reduce runs 3 blocks of 1000 calls (~5 ms each at p = 2) and a
64 MiB one 3 blocks of 1 call, so large sizes stay quick.  ``-w 0`` skips warm-up and calibration: every block
is exactly ``iters`` calls (nccl-tests' fixed count; the budget cannot shorten a block it never measured).

Every point also times :data:`~mpcomm.bench.base.RAW`, the MPI library's blocking collective called straight
from mpi4py, in the same rounds: ``overhead`` (this time / raw time) is what mpcomm adds to the MPI call.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import numpy as np
from mpi4py import MPI

from .all_gather import AllGather
from .allreduce import AllReduce
from .alltoall import AllToAll
from .base import RAW, Collective
from .broadcast import Broadcast
from .gather import Gather
from .reduce import Reduce
from .reduce_scatter import ReduceScatter
from .scatter import Scatter
from .sendrecv import SendRecv

COLLECTIVES: dict[str, type[Collective]] = {
    c.name: c for c in (AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, Gather, Scatter, AllToAll, SendRecv)
}

GB = 1e9
BLOCK_SECONDS = 0.01         # a timed block lasts this long, or -n calls, whichever comes first
CALIBRATION_SECONDS = 0.001  # a trial block this long measures the per-call time within the barrier's skew


def busbw_factor(operation: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: allreduce 2(p-1)/p; reduce_scatter, all_gather, gather, scatter and
    alltoall (p-1)/p; broadcast, reduce and sendrecv 1."""
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
class SweepSpec:
    """Everything the sweep needs, already validated (the CLI builds it from argv)."""

    operation: str
    algorithms: list[str]
    sizes: list[int]
    combos: list[tuple[np.dtype, str]]   # (dtype, redop) pairs; redop "none" for non-reducing operations
    warmup: int = 5
    iters: int = 1000   # calls per block, at most
    budget: float = 1.0  # seconds of timed calls per algorithm and point, split over the rounds
    rounds: int = 3
    check: bool = False
    root: int = 0
    seed: int = 1234
    skipped: list[str] = field(default_factory=list)


@dataclass
class Timing:
    seconds: float  # per call
    iters: int      # timed calls in all rounds
    warmup: int     # untimed calls (warm-up and calibration)
    block: int      # calls per block


def timed_block(step: Callable[[], object], world: MPI.Comm, calls: int) -> float:
    """Seconds of ``calls`` back-to-back calls of ``step`` after a barrier: the maximum over ranks."""
    world.Barrier()
    start = MPI.Wtime()
    for _ in range(calls):
        step()
    return world.allreduce(MPI.Wtime() - start, op=MPI.MAX)


def block_calls(per_call: float, iters: int, budget: float) -> int:
    """Calls in a block: as many as last BLOCK_SECONDS or ``iters``, whichever is fewer, within ``budget``
    seconds, at least one."""
    if per_call <= 0:
        return iters
    return max(1, min(iters, math.ceil(BLOCK_SECONDS / per_call), int(budget / per_call)))


def calibrate(step: Callable[[], object], world: MPI.Comm, warmup: int, iters: int, budget: float) -> tuple[int, int]:
    """Warm up and choose the block length: (calls per block, untimed calls made).

    Trial blocks of 1, 4, 16, ... calls until one lasts CALIBRATION_SECONDS or reaches ``iters`` calls and at
    least ``warmup`` calls were made; past ``warmup`` calls the trials stop early where the next would pass half
    of ``budget``.
    The per-call time is the least of the trials': barrier skew, a cold first call or a rank descheduled on a
    shared machine only ever lengthen a trial, and a length chosen from an inflated time would be too short.
    ``warmup`` 0: no trial, blocks of ``iters`` calls.
    """
    if warmup <= 0:
        return iters, 0
    calls, made, spent, per_call = 1, 0, 0.0, float("inf")
    while True:
        elapsed = timed_block(step, world, calls)
        made, spent, per_call = made + calls, spent + elapsed, min(per_call, elapsed / calls)
        settled = elapsed >= CALIBRATION_SECONDS or calls >= iters
        if settled and made >= warmup:
            break
        grown = min(4 * calls, iters) if not settled else calls
        if made >= warmup and spent + elapsed * grown / calls > budget / 2:  # (the warm-up calls are promised)
            break
        calls = grown
    return block_calls(per_call, iters, budget), made


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


def resolved_algorithm(comm, operation: str, nbytes: int, dtype, redop: str | None = None) -> str | None:
    """What "auto" picks for this call (``redop``: a reduction's op), where the selector says so (None otherwise)."""
    selector = getattr(comm, "selector", None)
    if selector is None:
        return None
    try:
        return str(selector.choose(operation, nbytes, np.dtype(dtype), redop))
    except Exception:  # noqa: BLE001 - informative only; a selector with another interface is fine
        return None


def _reduction(cls, redop: str) -> str | None:
    """The op of a reducing collective's calls (what auto's choice depends on), None for data movement."""
    return redop if cls.operation_name() in ("allreduce", "reduce_scatter", "reduce") else None


def timed_algorithms(operation: str, algorithms: list[str]) -> list[str]:
    """The rows of every point, in order: the raw MPI call, "native" (the ``vs_native`` baseline, added when
    the operation has one), then the requested algorithms."""
    cls = COLLECTIVES[operation]
    baselines = [RAW] + (["native"] if "native" in cls.algorithms() else [])
    return baselines + [a for a in algorithms if a not in baselines]


def sweep(comm, spec: SweepSpec, on_rows: Callable[[list[dict]], None] | None = None,
          progress: Callable[[int, int, str], None] | None = None) -> list[dict]:
    """Run every (size, dtype, redop, algorithm) point of ``spec``; returns the rows (identical on every rank).

    The raw MPI call and "native" (when the operation has one) are timed at every point, so ``overhead``
    (this time / raw time) and ``vs_native`` (native time / this time, > 1 = faster than native) are known
    for every row.
    """
    cls = COLLECTIVES[spec.operation]
    world, p = comm.mpi, comm.size
    order = timed_algorithms(spec.operation, spec.algorithms)
    total = len(spec.sizes) * len(spec.combos) * len(order)
    rows: list[dict] = []
    done = 0
    for dtype, redop in spec.combos:
        seen: set[int] = set()
        for requested in spec.sizes:
            count, size = cls.layout(requested, dtype.itemsize, p)
            if size in seen:  # several requested sizes can round to the same element count
                continue
            seen.add(size)
            case = cls(comm, count, dtype, redop if cls.reduces else "sum", spec.root, spec.seed)
            block = []
            try:
                timings = _interleaved_timings(case, order, world, spec)
                for algorithm in order:
                    if progress is not None:
                        progress(done, total, f"{spec.operation} {size} B {dtype} {redop} {algorithm}")
                    wrong, identical = case.check(algorithm) if spec.check else (None, None)
                    block.append(_row(spec, cls, comm, size, count, dtype, redop, algorithm, timings[algorithm],
                                      wrong, identical))
                    done += 1
            finally:
                case.close()
            _compare(block)
            rows.extend(block)
            if on_rows is not None:
                on_rows(block)
    return rows


def _compare(block: list[dict]) -> None:
    """Fill ``vs_native`` and ``overhead`` of the rows of one point."""
    times = {row["algorithm"]: row["time_us"] for row in block}
    native, raw = times.get("native"), times[RAW]
    for row in block:
        mine = row["time_us"]
        row["vs_native"] = native / mine if native and mine > 0 else None
        row["overhead"] = mine / raw if raw > 0 else None


def _interleaved_timings(case, algorithms: list[str], world: MPI.Comm, spec: SweepSpec) -> dict[str, Timing]:
    """Time every algorithm of one point in ``spec.rounds`` round-robin rounds; per algorithm the median round.

    Each round is an nccl-tests block (:func:`timed_block`) with ``budget / rounds`` seconds; the first round
    calibrates the block length (:func:`calibrate`, which is also the warm-up) and the later rounds reuse it
    after one or two untimed calls; each round starts one algorithm later than the one before.  Round-robin
    puts every algorithm under the same load drift of a shared machine, so two algorithms that are really equal
    also measure equal.
    """
    rounds, budget = spec.rounds, spec.budget / spec.rounds
    steps = {a: case.call(a) for a in algorithms}
    blocks: dict[str, list[float]] = {a: [] for a in algorithms}
    length: dict[str, tuple[int, int]] = {}
    for r in range(rounds):
        shift = r % len(algorithms)  # rotate the order, so no algorithm always follows the same one
        for algorithm in algorithms[shift:] + algorithms[:shift]:
            step = steps[algorithm]
            if r == 0:
                length[algorithm] = calibrate(step, world, spec.warmup, spec.iters, budget)
            else:
                # a call or two untimed first: the algorithm before it in the round left other code in the caches
                for _ in range(min(spec.warmup, 2)):
                    step()
            calls = length[algorithm][0]
            blocks[algorithm].append(timed_block(step, world, calls) / calls)
    return {a: Timing(float(np.median(blocks[a])), rounds * length[a][0], length[a][1], length[a][0])
            for a in algorithms}


def _row(spec, cls, comm, size, count, dtype, redop, algorithm, timing: Timing, wrong, identical) -> dict:
    seconds = timing.seconds
    algbw = size / seconds / GB if seconds > 0 else 0.0
    return {
        "collective": spec.operation,
        "size": size,
        "count": count,
        "dtype": str(dtype),
        "op": redop,
        "redop": redop,
        "root": spec.root if cls.rooted else None,
        "algorithm": algorithm,
        "resolved": (resolved_algorithm(comm, cls.operation_name(), size, dtype, _reduction(cls, redop))
                     if algorithm == "auto" else algorithm),
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": algbw * cls.busbw_factor(comm.size),
        "wrong": wrong,
        "identical": identical,
        "vs_native": None,
        "overhead": None,
        "iters": timing.iters,
        "block": timing.block,
        "rounds": spec.rounds,
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
