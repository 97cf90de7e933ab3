"""Pipeline hand-off: how long a stage boundary costs when the receiving stage is waiting for it.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/pipeline_handoff.py

Two pipeline ranks (pp = 2) train a stack of TransformerMLPBlocks with 1F1B and the executor's trace on
(``PipelineParallel.trace``: ``(label, t0, t1)`` of every compute action, send and wait, ``time.perf_counter``,
one clock for every process of a host). A hand-off is the time from the end of the sender's compute of a
micro-batch (forward of stage s, or backward of stage s+1) to the start of the receiver's compute on it, counted
only when the receiver was already blocked waiting for that message — so it is the cost of the boundary itself
(isend, the transfer, the receive completing, the executor's bookkeeping), not queueing behind other work.
Reports the median and quartiles over every such hand-off of ``--steps`` steps (after ``--warmup``), and the
payload of one message.

Then the floor, in the same job: rank 0 runs its stage's forward of one micro-batch (whose matmuls evict the
caches) and hands the result to rank 1, waiting in a receive, through raw mpi4py
(``Isend``/``Recv``) and through ``comm.isend``/``comm.recv``: what any executor pays for a message sent right
after compute on this machine (MPI's own calls run cache-cold then: a header ``Isend`` measured 0.9 us warm and
16 us right after a matmul).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from mpcomm import Communicator
from mpcomm.nn import transformer_mlp_stack
from mpcomm.parallel.pipeline import PipelineParallel
from traced_pipeline import producer_stage, spans_of, traced_steps, two_ranks  # bench/traced_pipeline.py


def handoffs(traces: list[list[tuple]]) -> list[float]:
    """Seconds of every hand-off the receiver waited for, from the two ranks' traces of one step."""
    spans = spans_of(traces)
    out = []
    for label, (wait_start, _) in spans.items():
        if label.startswith("WRECV_"):  # a waited receive "WRECV_F1.3"; its compute "F1.3"
            kind, (stage, mb) = label[6], map(int, label[7:].split("."))
            produced = spans.get(f"{kind}{producer_stage(kind, stage)}.{mb}")  # who computed the message
            consumed = spans.get(f"{kind}{stage}.{mb}")
            if produced is not None and consumed is not None and wait_start <= produced[1]:
                out.append(consumed[0] - produced[1])  # the receiver was idle, waiting, when the sender finished
    return out


def handoff_floor(comm: Communicator, compute, shape: tuple, reps: int) -> dict[str, list]:
    """Seconds from the end of rank 0's ``compute()`` (its stage's forward of one micro-batch) to rank 1's receive
    of the result returning, through raw MPI and through mpcomm, interleaved; measured on rank 1, returned on
    every rank."""
    world, rank = comm.mpi, comm.rank
    out = np.empty(shape)
    ways = {"raw mpi4py Isend/Recv": (lambda h: world.Isend(h, 1, 3).Wait(), lambda: world.Recv(out, 0, 3)),
            "mpcomm isend/recv": (lambda h: comm.isend(h, 1, tag=3).wait(), lambda: comm.recv(out, 0, tag=3))}
    times: dict[str, list] = {name: [] for name in ways}
    for _ in range(reps):
        for name, (send, receive) in ways.items():
            world.Barrier()
            if rank == 0:
                h = np.ascontiguousarray(compute())  # the matmuls leave the caches cold for what follows
                end = time.perf_counter()
                send(h)
                world.send(end, dest=1, tag=9)
            elif rank == 1:
                receive()
                done = time.perf_counter()  # one clock for every process of a host
                times[name].append(done - world.recv(source=0, tag=9))
    return world.bcast(times, root=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", default="256x1024", help="d_model x d_hidden of each block")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--mb-rows", type=int, default=64)
    ap.add_argument("--layers-per-stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--shared-memory", choices=("on", "off"), default="on",
                    help="PipelineParallel's shared_memory: hand-offs through the node's shared memory, or MPI")
    args = ap.parse_args(argv)
    comm = two_ranks()
    d_model, d_hidden = (int(x) for x in args.width.split("x"))
    model = transformer_mlp_stack(2 * args.layers_per_stage, d_model, d_hidden, seed=0)
    pipe = PipelineParallel(model, comm, args.micro_batches, schedule="1f1b", shared_memory=args.shared_memory == "on")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.micro_batches * args.mb_rows, d_model))
    y = rng.standard_normal(x.shape)
    gaps = []
    for _ in traced_steps(pipe, x, y, args.steps, args.warmup):
        gaps.extend(handoffs(comm.mpi.allgather(pipe.trace)))
    first = pipe.chunks[0]  # rank 0's stage: the floor's sender computes what the pipeline's does
    floor = handoff_floor(comm, lambda: first.forward(x[: args.mb_rows])[0], (args.mb_rows, d_model),
                          args.steps * 8)
    if comm.rank == 0:
        us = np.array(gaps) * 1e6
        q1, median, q3 = np.percentile(us, [25, 50, 75])
        print(f"pp = 2, 1f1b, {args.micro_batches} micro-batches of {args.mb_rows} x {d_model} float64 "
              f"({args.mb_rows * d_model * 8 / 1024:.0f} KiB per message), width {args.width}, {args.steps} steps")
        path = "the node's shared memory" if pipe._shared.all_shared else "MPI messages"
        print(f"hand-offs through {path}; each send tested after it for at most {pipe.spin_after_send * 1e3:g} ms "
              "(measured at the first step; 0: not needed)")
        print(f"hand-offs the receiver waited for: {us.size}; median {median:.1f} us "
              f"(quartiles {q1:.1f} - {q3:.1f} us, min {us.min():.1f} us)")
        for name, values in floor.items():
            q1, median, q3 = np.percentile(np.array(values) * 1e6, [25, 50, 75])
            print(f"the same message right after the same compute, {name}: median {median:.1f} us "
                  f"(quartiles {q1:.1f} - {q3:.1f} us)")
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
