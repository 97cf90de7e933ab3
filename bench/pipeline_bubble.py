"""Measured pipeline bubble vs theory, per schedule.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 900 mpiexec -n P python bench/pipeline_bubble.py --record

Runs with pp = P (the whole world) a compute-heavy stack of TransformerMLPBlocks through PipelineParallel for
gpipe, 1f1b and interleaved-1f1b (v=2) at several micro-batch counts and two model widths (``--widths``; the
narrow one makes chunks of ~4 ms, the wide one ~13 ms on the 2-core dev VM, so the fixed cost of each hand-off
between stages shows against the first and not the second), and records per rank and step:
compute (F + B time), blocked-in-receive time and total.  The measured bubble of a step is
``1 - sum_r compute_r / (P * max_r total_r)`` (the idle share of the P x makespan rectangle, as
``schedules.Timeline.bubble_fraction`` defines it); the median over the timed steps is reported (every step's value
is in the JSON), since a shared VM's hiccups land on single steps; it is compared with
``bubble_fraction_theory(P, m, v) = (P-1)/(v*m+P-1)`` and with the step replayed: ``simulate_timeline`` of the
same schedule fed every action's measured duration (the executor's trace) and free messages. The theory assumes
equal, steady stages; the replay has this run's compute as it was (the last stage's loss, a vCPU the host gives
less time to), so measured / replayed is what the hand-offs and the executor cost, and replayed / theory what the
compute's imbalance does.

glibc returns freed memory to the OS (heap trim, mmap for blocks over 128 KiB by default); every step then
page-faults its activations back in, more on some ranks than others, which shows as imbalance. Like the
allocator advice of PyTorch's CPU performance guides (jemalloc/tcmalloc), the benchmark keeps freed memory in the
process (``mallopt`` M_TRIM_THRESHOLD / M_MMAP_THRESHOLD, glibc only); ``--malloc-default`` measures without it.

With ``--record`` a run writes ``bench/results/pipeline_bubble_pp{P}.json`` and regenerates the tables of
``bench/results/pipeline_bubble.md`` from every JSON present, keeping the notes written below them; without it (as
for a partial run: ``--widths``, ``--micro-batches``) it only prints.  ``--spin-after-send`` is passed to
PipelineParallel (``auto``, or seconds: 0 never tests a send after it), ``--shared-memory on|off`` too.  Honest
caveat: with more ranks than cores (4 ranks on a 2-core machine) ranks share cores, so an "idle" rank is partly
just descheduled and compute times stretch — the numbers then say little.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import time

import numpy as np

from glibc_malloc import keep_freed_memory  # bench/glibc_malloc.py
from mpcomm import Communicator
from mpcomm.nn import SGD, transformer_mlp_stack
from mpcomm.parallel.pipeline import PipelineParallel
from mpcomm.parallel.schedules import bubble_fraction_theory, schedule as make_schedule
from traced_pipeline import replay, spans_of  # bench/traced_pipeline.py

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def run_case(comm, schedule: str, v: int, m: int, d_model: int, d_hidden: int, args) -> dict:
    pp = comm.size
    layers = pp * v * args.layers_per_chunk
    model = transformer_mlp_stack(layers, d_model, d_hidden, seed=0)
    spin = args.spin_after_send if args.spin_after_send == "auto" else float(args.spin_after_send)
    pipe = PipelineParallel(model, comm, m, schedule=schedule, virtual_stages=v, spin_after_send=spin,
                            shared_memory=args.shared_memory == "on")
    opt = SGD(pipe.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    rows = m * args.mb_rows
    x = rng.standard_normal((rows, d_model))
    y = rng.standard_normal((rows, d_model))
    lists = make_schedule(schedule, pp, m, v)
    per_step, replayed_per_step = [], []
    for step in range(args.warmup + args.steps):
        comm.barrier()
        pipe.trace = []
        pipe.train_step(x, y)
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            t = pipe.last_timing
            row = np.array([t["compute"], t["comm_wait"], t["total"], t["forward"], t["backward"]])
            table = np.empty((pp, 5))
            comm.all_gather(row, table)
            per_step.append(table)
            replayed_per_step.append(replay(lists, spans_of(comm.mpi.allgather(pipe.trace)), False).bubble_fraction)
    steps = np.stack(per_step)  # (steps, pp, 5)
    per_step_bubble = [1 - s[:, 0].sum() / (pp * s[:, 2].max()) for s in steps]
    measured = float(np.median(per_step_bubble))
    t_f = float(steps[:, :, 3].sum() / (steps.shape[0] * pp * v * m))  # mean time of one chunk forward
    t_b = float(steps[:, :, 4].sum() / (steps.shape[0] * pp * v * m))
    return {"pp": pp, "schedule": schedule, "v": v, "m": m, "layers": layers, "d_model": d_model,
            "d_hidden": d_hidden, "mb_rows": args.mb_rows, "steps": args.steps,
            "theory": bubble_fraction_theory(pp, m, v), "replayed": float(np.median(replayed_per_step)),
            "measured": measured, "measured_per_step": [float(b) for b in per_step_bubble],
            "replayed_per_step": [float(b) for b in replayed_per_step],
            "t_f_ms": 1e3 * t_f, "t_b_ms": 1e3 * t_b,
            "step_s": float(steps[:, :, 2].max(axis=1).mean()),
            "compute_s_per_rank": [float(c) for c in steps[:, :, 0].mean(axis=0)],
            "wait_s_per_rank": [float(c) for c in steps[:, :, 1].mean(axis=0)]}


# The line under the generated tables of pipeline_bubble.md; what follows it is written by hand and kept.
NOTES = "<!-- notes below are written by hand; bench/pipeline_bubble.py --record regenerates only what is above -->"


def write_markdown() -> str:
    markdown = os.path.join(RESULTS, "pipeline_bubble.md")
    notes = ""
    if os.path.exists(markdown):
        with open(markdown) as f:
            old = f.read()
        notes = old[old.index(NOTES):] if NOTES in old else ""
    runs = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "pipeline_bubble_pp*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    lines = ["# Pipeline bubble: measured vs theory", "",
             "Command: `OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 900 mpiexec -n P python "
             "bench/pipeline_bubble.py --record` (P = 2, 4).", "",
             "Generated by `bench/pipeline_bubble.py` (see its docstring for the method). Bubble = idle share of the",
             "P x makespan rectangle, `1 - sum_r compute_r / (P * max_r step_time_r)`, median over the timed steps.",
             "`theory` = (P-1)/(v*m+P-1) (equal, steady stages); `replayed` = each step replayed in",
             "`simulate_timeline` with every action's measured duration and free messages (the compute's imbalance as",
             "it was); `measured` = from the run. measured / replayed is what hand-offs and the executor cost;",
             "replayed / theory the compute's imbalance (the last stage's loss, vCPUs the host serves unequally).",
             "`-`: recorded before the replay existed.",
             ""]
    for run in runs:
        meta = run["meta"]
        lines += [f"## pp = {meta['pp']} ({meta['cores']} cores on this machine; {meta['platform']}; "
                  f"glibc keeps freed memory: {meta.get('keep_freed_memory', False)})", ""]
        if "command" in meta:
            lines += [f"`{meta['command']}`, {meta['taken']}.", ""]
        if meta["pp"] > meta["cores"]:
            lines += [f"**Oversubscribed: {meta['pp']} ranks on {meta['cores']} cores.** Ranks share cores, so "
                      "compute times stretch and idle time is partly time descheduled; these rows do not measure "
                      "the schedule's bubble faithfully.", ""]
        lines += ["| width | schedule | v | m | layers | theory | replayed | measured | measured / theory | "
                  "measured / replayed | F ms | B ms | step s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in run["cases"]:
            replayed = c.get("replayed")  # absent from runs recorded before the replay
            replay_cells = ("-", "-") if replayed is None else (f"{replayed:.3f}", f"{c['measured'] / replayed:.2f}")
            lines.append(f"| {c['d_model']}x{c['d_hidden']} | {c['schedule']} | {c['v']} | {c['m']} | {c['layers']} | "
                         f"{c['theory']:.3f} | {replay_cells[0]} | {c['measured']:.3f} | "
                         f"{c['measured'] / c['theory']:.2f} | {replay_cells[1]} | {c['t_f_ms']:.2f} | "
                         f"{c['t_b_ms']:.2f} | {c['step_s']:.3f} |")
        lines.append("")
    text = "\n".join(lines) + ("\n" + notes if notes else "")
    with open(markdown, "w") as f:
        f.write(text)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="256x1024,512x2048",
                   help="comma list of d_model x d_hidden of the TransformerMLPBlocks")
    p.add_argument("--mb-rows", type=int, default=64)
    p.add_argument("--layers-per-chunk", type=int, default=2)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--micro-batches", default=None, help="comma list of multiples of pp (default 1,2,4)")
    p.add_argument("--malloc-default", action="store_true",
                   help="leave glibc's malloc settings alone (freed memory goes back to the OS)")
    p.add_argument("--quick", action="store_true", help="small model, 1 step (smoke test)")
    p.add_argument("--spin-after-send", default="auto", help="PipelineParallel's spin_after_send: auto or seconds")
    p.add_argument("--shared-memory", choices=("on", "off"), default="on",
                   help="PipelineParallel's shared_memory: hand-offs through the node's shared memory, or MPI")
    p.add_argument("--record", action="store_true",
                   help="write bench/results/pipeline_bubble_pp{P}.json and regenerate pipeline_bubble.md's tables")
    args = p.parse_args(argv)
    if args.quick:
        args.widths, args.mb_rows, args.steps = "32x64", 8, 1
    widths = [tuple(int(n) for n in w.split("x")) for w in args.widths.split(",")]
    kept = False if args.malloc_default else keep_freed_memory()
    comm = Communicator()
    pp = comm.size
    factors = [int(f) for f in args.micro_batches.split(",")] if args.micro_batches else [1, 2, 4]
    cases = []
    for d_model, d_hidden in widths:
        for f in factors:
            m = f * pp
            for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
                t0 = time.perf_counter()
                c = run_case(comm, schedule, v, m, d_model, d_hidden, args)
                cases.append(c)
                if comm.rank == 0:
                    print(f"pp={pp} {d_model}x{d_hidden} {schedule:17s} v={v} m={m:3d}: theory {c['theory']:.3f}  "
                          f"replayed {c['replayed']:.3f}  measured {c['measured']:.3f}  (F {c['t_f_ms']:.2f} ms, "
                          f"B {c['t_b_ms']:.2f} ms, {time.perf_counter() - t0:.1f} s)", flush=True)
    if comm.rank == 0 and args.record and not args.quick:
        meta = {"pp": pp, "cores": os.cpu_count(), "platform": platform.platform(),
                "command": f"mpiexec -n {pp} python bench/pipeline_bubble.py " + " ".join(
                    sys.argv[1:] if argv is None else argv),
                "taken": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "threads": os.environ.get("OMP_NUM_THREADS", "unset"), "python": sys.version.split()[0],
                "keep_freed_memory": kept}
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"pipeline_bubble_pp{pp}.json"), "w") as f:
            json.dump({"meta": meta, "cases": cases}, f, indent=1)
        print(write_markdown())


if __name__ == "__main__":
    main()
