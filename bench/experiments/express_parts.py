"""What each part of a small blocking all-reduce's Python costs, around its one C call (issue 32's 2x of raw).

``comm.allreduce(buf)`` of a small host array whose plan is made runs ``Dispatcher.run_express``: it checks that
nothing else must run first, makes the plan's C call (``native_calls.ExpressCall``, which takes the transport's
lock, reads the clock around the all-reduce, counts it into the stats and lets the lock go) and writes the flight
recorder's entry. Timed whole and part by part, each part as ``dispatch.py`` writes it, and the C call beside the
same all-reduce without its books (``native_calls.allreduce``). One process: p = 1 has no express call of its own,
so the plan's is made by hand, over a real ``MPI_Iallreduce`` of the one rank:

    python bench/experiments/express_parts.py [--calls 200000] [--repeat 7]

Prints nanoseconds per call, the best of ``--repeat`` loops of ``--calls``.
"""
from __future__ import annotations

import argparse
import timeit

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.native_calls import load

PARTS = {
    "comm.allreduce(buf), whole": "comm.allreduce(buf, algorithm='native')",
    "  the plan's lookup (_planned_allreduce)": "comm._planned_allreduce(buf, 'sum', 'native')",
    "  run_express(plan, buf), whole": "comm.run_express(plan, buf)",
    "    the C call, with its books": "plan.express(buf)",
    "      the same all-reduce without them": "calls.allreduce(t.fortran, buf, op, 0, 1)",
    "    the gates (validate, unusable, queued work)": "comm._meet; comm._unusable; comm._inline",
    "    the flight recorder's entry": "lane.collectives += 1; slot = next(lane.slots); lane.groups[slot] = lane; "
                                      "lane.calls[slot] = plan; lane.starts[slot] = plan.express.started; "
                                      "lane.ends[slot] = plan.express.ended",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    calls = load()
    if calls is None:
        raise SystemExit("mpcomm.native_calls is not built here: there are no express calls")
    comm = Communicator(MPI.COMM_SELF)
    buf = np.ones(2, np.float32)
    comm.allreduce(buf, algorithm="native")  # (the plan is made)
    plan = comm._planned_allreduce(buf, "sum", "native")
    t, op = comm.transport, MPI.SUM.py2f()
    plan.express = calls.ExpressCall((t.fortran, op, 0, 1), t.in_use, plan.totals, float(buf.nbytes))
    if t.trace is None:
        raise SystemExit("the flight recorder is off (MPCOMM_TRACE_BUFFER=0): its entry cannot be timed")
    names = {"comm": comm, "buf": buf, "plan": plan, "t": t, "op": op, "calls": calls, "lane": t.trace}
    for part, statement in PARTS.items():
        best = min(timeit.repeat(statement, globals=names, number=args.calls, repeat=args.repeat))
        print(f"{part:<52} {best / args.calls * 1e9:7.0f} ns")
    comm.free()


if __name__ == "__main__":
    main()
