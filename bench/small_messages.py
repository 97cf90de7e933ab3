"""Small messages: mpcomm's per-call cost against raw mpi4py, measured in one job.

``mpiexec -n P python bench/small_messages.py [--calls 3000] [--rounds 7] [--sizes 8,64,512,4096] [--json FILE]``

For each size (8 B .. 4 KiB) and each contender — raw ``MPI.Comm.Allreduce``, raw ``Iallreduce`` + ``Test`` loop
(what a bounded wait costs in MPI alone), raw persistent ``Allreduce_init`` request's ``Start`` + ``Test`` loop (and
``native_calls.start``, which copies the buffer in and out around it in C: native's persistent way),
``comm.allreduce`` with ``auto``/``native``/``tree``/``rhd`` (rhd on two ranks: its exchange in one C call) (and,
marked ``no trace``, on a Communicator with the flight recorder off: the recorder's cost is the difference; and
where native's plan makes the call in one C call, that C call alone (which takes the lock, reads the clock and
counts the stats itself), the plan's lookup and that call with nothing else (what any dispatcher that finds its plan
in Python costs at least), and ``run_express``, which adds the gates and the recorder's entry: the rest is
``Communicator.allreduce``'s own call) — times a loop of ``--calls`` calls after a barrier, round-robin over the
contenders, ``--rounds`` times (so load drift hits all alike); a loop's time is the maximum over ranks. Reports the
median loop (and min/max as the spread) in microseconds per call, and each contender's ratio to raw ``Allreduce`` of
the same size in the same run.
Point to point: a ping-pong between ranks 0 and 1 (``send`` then ``recv``, the partner the reverse), raw
``Send``/``Recv`` against ``comm.send``/``comm.recv``; microseconds per round trip.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms import EXPRESS, native
from mpcomm.native_calls import load as load_calls

SIZES = [8, 64, 512, 4096]


def allreduce_contenders(comm: Communicator, untraced: Communicator, buf: np.ndarray) -> dict:
    """``untraced``: a Communicator with the flight recorder off, for the recorder's cost in the same run."""
    world = comm.mpi
    # native's persistent request for buf's all-reduce (made on comm's transport, freed with it; MPI-4)
    entry = native._persistent_allreduce(comm._sync, buf, MPI.SUM, (buf.size, buf.dtype, "sum", True))
    persistent, own, handle = entry if entry is not None else (None, None, None)
    calls = load_calls()

    def iallreduce_test():
        request = world.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM)
        while not request.Test():
            pass

    def persistent_start_test():
        persistent.Start()
        while not persistent.Test():
            pass

    contenders = {
        "raw Allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
        "raw Iallreduce+Test": iallreduce_test,
        "mpcomm auto": lambda: comm.allreduce(buf),
        "mpcomm auto, no trace": lambda: untraced.allreduce(buf),
        "mpcomm native": lambda: comm.allreduce(buf, algorithm="native"),
        "mpcomm native, no trace": lambda: untraced.allreduce(buf, algorithm="native"),
        "mpcomm tree": lambda: comm.allreduce(buf, algorithm="tree"),
        "mpcomm rhd": lambda: comm.allreduce(buf, algorithm="rhd"),  # (two ranks: its exchange's one C call)
    }
    if persistent is not None:
        contenders["raw persistent Start+Test"] = persistent_start_test  # (on its own buffer: no copies)
        if calls is not None:  # native_calls.start: buf copied in, started, tested until done, copied back, in C
            contenders["persistent: C start call"] = lambda: calls.start(handle, own, buf, 0, 1 << 30)
    plan = comm.plan("allreduce", buf, "sum", "native")  # (the plan comm.allreduce(buf, algorithm="native") runs)
    if plan.express is not None:  # the steps of that call: its C call alone, then with run()'s work around it
        def express_call(found=plan):
            outcome = found.express(buf)
            if outcome is not None:  # (not done within its tests: what run_express does then, without the rest)
                EXPRESS[found.algorithm][1](comm._sync, buf, found.rop, outcome)
                comm._sync.in_use.release()

        def looked_up_call():  # the floor of a dispatcher that finds the plan in Python (the C call keeps the books)
            express_call(comm._planned_allreduce(buf, "sum", "native"))

        contenders["native: express C call"] = express_call
        contenders["native: lookup + C call"] = looked_up_call
        contenders["native: run_express"] = lambda: comm.run_express(plan, buf)
    return contenders


def untraced_communicator() -> Communicator:
    """A Communicator over MPI.COMM_WORLD with the flight recorder off (MPCOMM_TRACE_BUFFER=0 while it is made)."""
    return communicator_with("MPCOMM_TRACE_BUFFER", "0")


def communicator_with(variable: str, value: str) -> Communicator:
    """A Communicator over MPI.COMM_WORLD made while environment ``variable`` is ``value``."""
    saved = os.environ.get(variable)
    os.environ[variable] = value
    try:
        return Communicator(MPI.COMM_WORLD)
    finally:
        if saved is None:
            del os.environ[variable]
        else:
            os.environ[variable] = saved


def pingpong_contenders(comm: Communicator, untraced: Communicator, buf: np.ndarray) -> dict:
    world, rank = comm.mpi, comm.rank
    out = np.empty_like(buf)
    partner = {0: 1, 1: 0}.get(rank)

    def raw():
        if rank == 0:
            world.Send(buf, 1, 0)
            world.Recv(out, 1, 0)
        elif rank == 1:
            world.Recv(out, 0, 0)
            world.Send(buf, 0, 0)

    def mpcomm_pingpong(comm):
        if rank == 0:
            comm.send(buf, partner)
            comm.recv(out, partner)
        elif rank == 1:
            comm.recv(out, partner)
            comm.send(buf, partner)

    return {"raw Send/Recv": raw, "mpcomm send/recv": lambda: mpcomm_pingpong(comm),
            "mpcomm send/recv, no trace": lambda: mpcomm_pingpong(untraced)}


def time_loop(world: MPI.Comm, call, calls: int) -> float:
    """Microseconds per call of a loop of ``calls`` calls, the maximum over ranks."""
    world.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    per_call = (time.perf_counter() - start) / calls * 1e6
    return world.allreduce(per_call, op=MPI.MAX)


def measure(world: MPI.Comm, contenders: dict, calls: int, rounds: int) -> dict[str, list[float]]:
    for call in contenders.values():  # warm-up: plans, caches, MPI's own lazy set-up
        for _ in range(min(200, calls)):
            call()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order each round
            times[name].append(time_loop(world, contenders[name], calls))
    return times


def sweep_arguments(parser: argparse.ArgumentParser, sizes: str, calls: int, rounds: int) -> None:
    """The options of a sweep of interleaved timed loops: --sizes, --calls, --rounds, --json."""
    parser.add_argument("--sizes", default=sizes, help=f"bytes, comma-separated (default {sizes})")
    parser.add_argument("--calls", type=int, default=calls, help="calls per timed loop, at most (fewer when large)")
    parser.add_argument("--rounds", type=int, default=rounds, help="round-robin rounds per point")
    parser.add_argument("--json", help="write the rows here (rank 0)")


def library_name() -> str:
    """The first line of the MPI library's version string (what each result names)."""
    return MPI.Get_library_version().splitlines()[0].strip()


def write_rows(path: str | None, comm: Communicator, rounds: int, rows: list) -> None:
    """``rows`` as JSON at ``path`` (None: nowhere), with the ranks, the MPI library and the rounds."""
    if path:
        with open(path, "w") as f:
            json.dump({"ranks": comm.size, "library": library_name(), "rounds": rounds, "rows": rows}, f, indent=1)


def print_rows(title: str, rows: list, ratio: str) -> None:
    """``title``, then a line per row of a sweep: bytes, contender, median and spread of the rounds (us), and the
    ratio to the reference under the heading ``ratio``."""
    print(title)
    print(f"{'bytes':>9} {'contender':30} {'median':>10} {'spread':>21} {ratio:>6}")
    for row in rows:
        spread = f"[{row['min_us']:.2f}-{row['max_us']:.2f}]"
        print(f"{row['bytes']:9d} {row['contender']:30} {row['median_us']:10.2f} {spread:>21} {row['ratio']:6.2f}")


def summarize(times: dict[str, list[float]], reference: str) -> list[dict]:
    base = float(np.median(times[reference]))
    return [{"contender": name, "median_us": float(np.median(t)), "min_us": min(t), "max_us": max(t),
             "ratio": float(np.median(t)) / base} for name, t in times.items()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sweep_arguments(parser, ",".join(map(str, SIZES)), calls=3000, rounds=7)  # (float32: sizes multiples of 4)
    args = parser.parse_args(argv)
    comm = Communicator(MPI.COMM_WORLD)
    untraced = untraced_communicator()
    world, rows = comm.mpi, []
    for nbytes in map(int, args.sizes.split(",")):
        buf = np.ones(nbytes // 4, np.float32)
        for row in summarize(measure(world, allreduce_contenders(comm, untraced, buf), args.calls, args.rounds),
                             "raw Allreduce"):
            rows.append({"test": "allreduce", "bytes": nbytes, **row})
    if comm.size >= 2:
        for nbytes in (8, 4096):
            buf = np.ones(nbytes // 4, np.float32)
            times = measure(world, pingpong_contenders(comm, untraced, buf), args.calls, args.rounds)
            for row in summarize(times, "raw Send/Recv"):
                rows.append({"test": "pingpong", "bytes": nbytes, **row})
    if comm.rank == 0:
        print(f"{comm.size} ranks, {args.calls} calls per loop, {args.rounds} rounds; us per call "
              "(ping-pong: per round trip), median [min-max] of the rounds, ratio to raw in the same run")
        print(f"{'test':10} {'bytes':>6} {'contender':26} {'median':>8} {'spread':>17} {'x raw':>6}")
        for row in rows:
            spread = f"[{row['min_us']:.2f}-{row['max_us']:.2f}]"
            print(f"{row['test']:10} {row['bytes']:6d} {row['contender']:26} {row['median_us']:8.2f} {spread:>17} "
                  f"{row['ratio']:6.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.size, "calls": args.calls, "rounds": args.rounds, "rows": rows}, f, indent=1)
    untraced.free()
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
