"""What each part of a small blocking all-reduce's Python costs, around its one C call (issue 32's 2x of raw).

``comm.allreduce(buf)`` of a small host array whose plan is made runs ``Dispatcher.run_express``: it checks that
nothing else must run first, takes the transport's lock, reads the clock, makes the plan's C call, writes the
flight recorder's entry and the stats, and lets the lock go. Here the C call is replaced by a C callable that does
nothing (``list.append``), so what is timed is the Python alone, whole and part by part, each part as
``dispatch.py`` writes it. One process (no partner is needed for Python's part; p = 1 has no express call of its
own, so the plan's is set by hand):

    python bench/experiments/express_parts.py [--calls 200000] [--repeat 7]

Prints nanoseconds per call, the best of ``--repeat`` loops of ``--calls``.
"""
from __future__ import annotations

import argparse
import timeit

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm import dispatch

PARTS = {
    "comm.allreduce(buf), whole": "comm.allreduce(buf, algorithm='native')",
    "  the plan's lookup (_planned_allreduce)": "comm._planned_allreduce(buf, 'sum', 'native')",
    "  run_express(plan, buf), whole": "comm.run_express(plan, buf)",
    "    the C call (a no-op C callable here)": "plan.express(buf)",
    "    the gates (validate, unusable, queued work)": "comm._meet; comm._unusable; comm._inline",
    "    the lock, taken and let go": "lock.acquire(False); lock.release()",
    "    the operation's name on the transport": "t.operation = plan.label",
    "    two clock readings": "clock(); clock()",
    "    the flight recorder's entry": "lane.collectives += 1; slot = next(lane.slots); lane.groups[slot] = lane; "
                                      "lane.calls[slot] = plan; lane.starts[slot] = 1.0; lane.ends[slot] = 2.0",
    "    the stats (the plan's entry)": "totals = plan.totals; totals[0] += 1; totals[1] += plan.nbytes; "
                                     "totals[2] += 1e-6",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    comm = Communicator(MPI.COMM_WORLD)
    buf = np.ones(2, np.float32)
    comm.allreduce(buf, algorithm="native")  # (the plan is made)
    plan = comm._planned_allreduce(buf, "sum", "native")
    sink: list = []
    plan.express = sink.append  # (returns None: "done", as the C call does once the all-reduce is)
    t = comm.transport
    if t.trace is None:
        raise SystemExit("the flight recorder is off (MPCOMM_TRACE_BUFFER=0): its entry cannot be timed")
    names = {"comm": comm, "buf": buf, "plan": plan, "t": t, "lock": t.in_use, "lane": t.trace,
             "clock": dispatch._clock}
    for part, statement in PARTS.items():
        best = min(timeit.repeat(statement, globals=names, number=args.calls, repeat=args.repeat))
        sink.clear()
        print(f"{part:<52} {best / args.calls * 1e9:7.0f} ns")
    comm.free()


if __name__ == "__main__":
    main()
