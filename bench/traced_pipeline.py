"""A two-stage pipeline trained step by step with the executor's trace on: the run that bench/pipeline_handoff.py
and bench/pipeline_idle.py read their figures from; and a traced step replayed in ``simulate_timeline`` with its
measured durations (pipeline_idle.py, pipeline_bubble.py)."""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from mpi4py import MPI

from glibc_malloc import keep_freed_memory  # bench/glibc_malloc.py
from mpcomm import Communicator
from mpcomm.nn import SGD
from mpcomm.parallel.pipeline import PipelineParallel
from mpcomm.parallel.schedules import Timeline, simulate_timeline


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


def producer_stage(kind: str, stage: int) -> int:
    """The stage whose output is the input of ``kind`` ("F" or "B") on ``stage``."""
    return stage - 1 if kind == "F" else stage + 1


def _received(spans: dict[str, tuple], kind: str, stage: int, mb: int) -> tuple | None:
    """``(receive span, its message's send span, arrived)`` of compute ``kind stage.mb``'s input from another rank,
    or None (its input was local); ``arrived``: the send ended before the receive began, so the receive's time was
    the receiver's own work (MPI's copy), not waiting."""
    receive = spans.get(f"WRECV_{kind}{stage}.{mb}")
    send = spans.get(f"SEND_{kind}{producer_stage(kind, stage)}.{mb}")
    if receive is None or send is None:
        return None
    return receive, send, send[1] < receive[0]


def send_latencies(spans: dict[str, tuple]) -> list[float]:
    """Seconds from the end of each send to the start of its receiver's compute on it, for the receives that were
    already waiting when the send ended (``spans``: trace label -> (t0, t1) of every rank's step)."""
    out = []
    for label in spans:
        if label.startswith(("F", "B")):
            kind, (stage, mb) = label[0], map(int, label[1:].split("."))
            received = _received(spans, kind, stage, mb)
            if received is not None and not received[2]:
                out.append(spans[label][0] - received[1][1])
    return out


def spans_of(traces: Sequence[list[tuple]]) -> dict[str, tuple]:
    """Trace label -> (t0, t1) of every action of one step, from the ranks' traces (labels name stages, so no
    two ranks share one)."""
    return {label: (t0, t1) for trace in traces for label, t0, t1 in trace}


def replay(lists: list, spans: dict[str, tuple], with_messages: bool) -> Timeline:
    """One step of schedule ``lists`` replayed in ``simulate_timeline`` with the durations its ``spans`` measured:
    compute only, or with the messages' cost to the ranks' own time added to each compute (the send after it, the
    receive before it of a message that had already arrived) and the step's median latency from a send's end to
    its waiting receiver's compute."""

    def duration(a) -> float:
        t0, t1 = spans[f"{a.kind}{a.stage}.{a.microbatch}"]
        if not with_messages:
            return t1 - t0
        send = spans.get(f"SEND_{a.kind}{a.stage}.{a.microbatch}")
        received = _received(spans, a.kind, a.stage, a.microbatch)
        return (t1 - t0 + (send[1] - send[0] if send else 0.0)
                + (received[0][1] - received[0][0] if received and received[2] else 0.0))

    latencies = send_latencies(spans) if with_messages else []
    latency = float(np.median(latencies)) if latencies else 0.0
    return simulate_timeline(lists, duration, duration, latency)
