"""What a second message costs a pipeline hand-off: raw mpi4py, one message against an envelope and a payload.

    OMP_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/experiments/handoff_protocols.py

Rank 0 computes (three matmuls, which leave the caches cold, as a pipeline stage's forward does), sends a
128 KiB activation and computes again before waiting for its sends (as the executor does); rank 1 waits for it.
Hand-off = from the end of rank 0's compute to rank 1 holding the data (one clock for the processes of a host).
Four ways, interleaved, raw mpi4py only (no mpcomm code):

* ``one message``              - ``Isend`` / ``Recv`` of the payload;
* ``envelope, then payload``   - mpcomm's protocol: a 32-byte envelope, then the payload on a second communicator,
  its receive posted once the envelope has arrived;
* ``payload receive pre-posted`` - the same two messages, the payload's receive posted before the envelope arrives;
* ``one message into scratch``  - one message received into a scratch buffer, then copied to its destination.

Prints the median hand-off, the sender's time in its send calls and when the receiver first saw the message
(the envelope, for the two-message ways).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

WAYS = ("one message", "envelope, then payload", "payload receive pre-posted", "one message into scratch")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=64, help="payload rows of 256 float64 (64: 128 KiB)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit("run with mpiexec -n 2")
    rank, payloads = world.Get_rank(), world.Dup()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 1024)), rng.standard_normal((1024, 256))
    data, out = np.ones((args.rows, 256)), np.empty((args.rows, 256))
    envelope, got_envelope = np.zeros(4, np.int64), np.empty(4, np.int64)

    def compute():
        for _ in range(3):
            a @ b

    def until_done(request):
        while not request.Test():
            pass

    results: dict[str, list] = {way: [] for way in WAYS}
    for _ in range(args.reps):
        for way in WAYS:
            world.Barrier()
            if rank == 0:
                compute()
                end = time.perf_counter()
                if way.startswith("one"):
                    requests = [world.Isend(data, 1, 3)]
                else:
                    requests = [world.Isend(envelope, 1, 3), payloads.Isend(data, 1, 7)]
                sent = time.perf_counter()
                compute()
                MPI.Request.Waitall(requests)
                world.send((end, sent), dest=1, tag=9)
                continue
            if way == "one message":
                world.Recv(out, 0, 3)
                seen = time.perf_counter()
            elif way == "one message into scratch":
                scratch = np.empty_like(out)
                world.Recv(scratch, 0, 3)
                seen = time.perf_counter()
                out[...] = scratch
            elif way == "envelope, then payload":
                until_done(world.Irecv(got_envelope, 0, 3))
                seen = time.perf_counter()
                until_done(payloads.Irecv(out, 0, 7))
            else:
                first, second = world.Irecv(got_envelope, 0, 3), payloads.Irecv(out, 0, 7)
                until_done(first)
                seen = time.perf_counter()
                until_done(second)
            done = time.perf_counter()
            end, sent = world.recv(source=0, tag=9)
            results[way].append((done - end, sent - end, seen - end))
    if rank == 1:
        print(f"{args.rows * 256 * 8 // 1024} KiB after three 256x1024 @ 1024x256 matmuls, {args.reps} hand-offs each; "
              "medians in us")
        print("| way | hand-off | sender in its send calls | receiver first sees the message |")
        print("|---|---:|---:|---:|")
        for way, rows in results.items():
            handoff, sending, seen = np.median(np.array(rows), axis=0) * 1e6
            print(f"| {way} | {handoff:.1f} | {sending:.1f} | {seen:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
