"""Where a pipeline rank's idle time goes: per-rank compute, receive waits, sends, the final drain and the loss
broadcast of each step, from the executor's trace.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/pipeline_idle.py --schedule 1f1b

The model and micro-batches are bench/pipeline_bubble.py's pp = 2 rows (TransformerMLPBlocks 192x768, 2 layers per
chunk, 64-row micro-batches). Beside the medians, each step is replayed in ``simulate_timeline`` with its own measured
durations, twice: with free messages (every action's compute only: what separates that from theory is the ranks'
unequal and varying compute, not messages), and with the messages as measured (``traced_pipeline.replay``: each
compute carries the send after it and the receive before it of a message that had already arrived, MPI's copy on
the receiver's time; the step's median latency from a send's end to its waiting receiver's compute). What separates
the measured step from the second replay is neither compute nor messages (the executor's own steps, the drain, the
loss broadcast).
"""
from __future__ import annotations

import argparse

import numpy as np

from mpcomm.nn import transformer_mlp_stack
from mpcomm.parallel.pipeline import PipelineParallel
from mpcomm.parallel.schedules import bubble_fraction_theory, schedule
from traced_pipeline import replay, send_latencies, spans_of, traced_steps, two_ranks  # bench/traced_pipeline.py

PARTS = ("compute", "forward", "backward", "wait", "send", "drain", "bcast", "other", "total")


def step_parts(pipe: PipelineParallel) -> dict[str, float]:
    """Seconds of each part of the step just run, from ``pipe.trace`` and ``pipe.last_timing``."""
    trace = pipe.trace
    parts = dict.fromkeys(PARTS, 0.0)
    for label, t0, t1 in trace[1:]:
        if label.startswith("WRECV"):
            parts["wait"] += t1 - t0
        elif label.startswith("SEND"):
            parts["send"] += t1 - t0
        elif label in ("drain", "bcast"):
            parts[label] += t1 - t0
    timing = pipe.last_timing
    parts["compute"], parts["forward"], parts["backward"] = timing["compute"], timing["forward"], timing["backward"]
    parts["total"] = trace[-1][2] - trace[0][1]
    parts["other"] = parts["total"] - sum(parts[k] for k in ("compute", "wait", "send", "drain", "bcast"))
    return parts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved-1f1b"))
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--shared-memory", choices=("on", "off"), default="on",
                    help="PipelineParallel's shared_memory: hand-offs through the node's shared memory, or MPI")
    args = ap.parse_args(argv)
    comm = two_ranks()
    v = 2 if args.schedule == "interleaved-1f1b" else 1
    model = transformer_mlp_stack(2 * 2 * v, 192, 768, seed=0)
    pipe = PipelineParallel(model, comm, args.micro_batches, schedule=args.schedule, virtual_stages=v,
                            shared_memory=args.shared_memory == "on")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.micro_batches * 64, 192))
    y = rng.standard_normal(x.shape)
    steps = [(step_parts(pipe), list(pipe.trace)) for _ in traced_steps(pipe, x, y, args.steps, args.warmup)]
    every = comm.mpi.gather(steps, root=0)
    if comm.rank == 0:
        m = args.micro_batches
        print(f"pp = 2, {args.schedule} (v = {v}), m = {m}, 192x768; medians over {args.steps} steps, ms")
        print("| rank | " + " | ".join(PARTS) + " |")
        print("|---" * (len(PARTS) + 1) + "|")
        medians = []
        for rank, rows in enumerate(every):
            med = {k: float(np.median([parts[k] for parts, _ in rows])) * 1e3 for k in PARTS}
            medians.append(med)
            print(f"| {rank} | " + " | ".join(f"{med[k]:.2f}" for k in PARTS) + " |")
        lists = schedule(args.schedule, 2, m, v)
        step_spans = [spans_of(traces) for traces in zip(*([trace for _, trace in rows] for rows in every))]
        latency = np.median([gap for spans in step_spans for gap in send_latencies(spans)] or [0.0])
        print(f"median send end -> waiting receiver's compute: {latency * 1e6:.1f} us")
        compute = sum(med["compute"] for med in medians)
        theory = bubble_fraction_theory(2, m, v)
        for name, step in (("measured", max(med["total"] for med in medians)),
                           ("replayed, free messages",
                            np.median([replay(lists, spans, False).makespan for spans in step_spans]) * 1e3),
                           ("replayed, messages as measured",
                            np.median([replay(lists, spans, True).makespan for spans in step_spans]) * 1e3)):
            bubble = 1 - compute / (2 * step)
            print(f"{name}: step {step:.2f} ms, bubble {bubble:.3f} = {bubble / theory:.2f} x theory")
    comm.free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
