"""FSDP memory per rank vs the full model, measured (not estimated), at several world sizes.

    python bench/fsdp_memory.py --procs 1,2,4 --out bench/results/fsdp_memory.md     # driver: runs mpiexec
    mpiexec -n 4 python bench/fsdp_memory.py --worker                               # one world size, JSON rows

Per rank and configuration it trains a few Adam steps of a transformer-MLP stack (one unit per block) and
reports, from ``engine.memory_stats()`` (bytes of the arrays the engine holds, with the peak of gathered
buffers tracked at every allocation and free), the peak parameter bytes = sharded params + most gathered
bytes alive at once, against the target 1.1 x (full/p + largest gathered unit). As an independent check it
also reports Python's ``tracemalloc`` peak over one training step (numpy registers its data allocations
there), which additionally includes activations, gradient temporaries, optimizer state and grads.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

CONFIGS = [("full_shard", None), ("full_shard", "pre"), ("shard_grad_op", None), ("no_shard", None)]


def worker(args) -> None:
    from mpi4py import MPI

    from mpcomm import Communicator
    from mpcomm.nn import Adam, TransformerMLPBlock, mse_loss
    from mpcomm.parallel.fsdp import FullyShardedDataParallel
    from mpcomm.workload import Workload

    comm = Communicator(MPI.COMM_WORLD)
    wl = Workload(num_layers=args.layers, d_model=args.d_model, d_hidden=args.d_hidden,
                  global_batch=args.batch, seed=0)
    rows = []
    for strategy, prefetch in CONFIGS:
        engine = FullyShardedDataParallel(wl.model(), comm, sharding_strategy=strategy,
                                          auto_wrap_policy={TransformerMLPBlock}, backward_prefetch=prefetch)
        opt = Adam(engine.parameters(), lr=1e-3)

        def step(s):
            xs, ys = wl.local_batch(s, comm.rank, comm.size)
            engine.zero_grad()
            out, ctx = engine.forward(xs)
            _, g = mse_loss(out, ys)
            engine.backward(g, ctx)
            opt.step()

        for s in range(args.steps - 1):
            step(s)
        comm.barrier()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        step(args.steps - 1)
        traced_peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        m = engine.memory_stats(opt)
        full, unit, p = m["full_model_bytes"], m["largest_unit_bytes"], comm.size
        target = 1.1 * (full / p + unit)
        row = {"p": p, "rank": comm.rank, "strategy": strategy, "prefetch": prefetch or "none",
               "full_model_bytes": full, "largest_unit_bytes": unit,
               "sharded_param_bytes": m["sharded_param_bytes"],
               "peak_gathered_param_bytes": m["peak_gathered_param_bytes"],
               "peak_param_bytes": m["peak_param_bytes"], "target_bytes": int(target),
               "meets_target": m["peak_param_bytes"] <= target,
               "peak_total_bytes": m["peak_total_bytes"], "optimizer_state_bytes": m["optimizer_state_bytes"],
               "tracemalloc_step_peak_bytes": traced_peak}
        rows.append(row)
        engine.remove_hooks()
    with open(os.path.join(args.rows_dir, f"rank{comm.rank}.json"), "w") as f:  # the driver keeps the worst rank
        json.dump(rows, f)
    comm.free()


def driver(args) -> None:
    rows = []
    here = os.path.abspath(__file__)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else "mpiexec"
    passthrough = ["--layers", str(args.layers), "--d-model", str(args.d_model), "--d-hidden", str(args.d_hidden),
                   "--batch", str(args.batch), "--steps", str(args.steps)]
    for p in [int(v) for v in args.procs.split(",")]:
        rows_dir = tempfile.mkdtemp(prefix="fsdp-memory-")
        cmd = [mpiexec, "-n", str(p), sys.executable, here, "--worker", "--rows-dir", rows_dir, *passthrough]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if out.returncode != 0:
            sys.exit(f"{shlex.join(cmd)} failed:\n{out.stdout}\n{out.stderr}")
        worst: dict = {}
        for name in sorted(os.listdir(rows_dir)):
            with open(os.path.join(rows_dir, name)) as f:
                rank_rows = json.load(f)
            for r in rank_rows:
                key = (r["strategy"], r["prefetch"])
                if key not in worst or r["peak_param_bytes"] > worst[key]["peak_param_bytes"]:
                    worst[key] = r
        shutil.rmtree(rows_dir)
        if len(worst) != len(CONFIGS):
            sys.exit(f"{shlex.join(cmd)}: expected {len(CONFIGS)} configurations, got {sorted(worst)}")
        rows += [worst[(s, pf or "none")] for s, pf in CONFIGS]
    table = render(rows, args)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table)


def render(rows, args) -> str:
    kib = lambda b: f"{b / 1024:.1f}"
    lines = [
        "# FSDP memory per rank (measured)",
        "",
        f"Command: `python bench/fsdp_memory.py --procs {args.procs} --layers {args.layers} --d-model {args.d_model} "
        f"--d-hidden {args.d_hidden} --batch {args.batch} --steps {args.steps} --out {args.out}`",
        "",
        f"Model: {args.layers} TransformerMLPBlocks (d_model={args.d_model}, d_hidden={args.d_hidden}), float64, "
        "one FSDP unit per block, Adam, global batch split over the ranks. "
        f"Run {time.strftime('%Y-%m-%d')} on a 2-core machine (ranks oversubscribed; memory, not time).",
        "",
        "Bytes from `engine.memory_stats()` of the rank with the largest peak. "
        "peak params = sharded params + most gathered param bytes alive at once during the last step; "
        "target = 1.1 x (full/p + largest unit). tracemalloc = peak of all numpy allocations during one step "
        "above the level before it (activations, gradient temporaries, grads and the gathered buffers).",
        "",
        "| p | strategy | prefetch | full model KiB | largest unit KiB | sharded params KiB | peak gathered KiB "
        "| peak params KiB | target KiB | meets | peak total KiB (params+grads+Adam+transient) | tracemalloc step KiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['p']} | {r['strategy']} | {r['prefetch']} | {kib(r['full_model_bytes'])} | "
                     f"{kib(r['largest_unit_bytes'])} | {kib(r['sharded_param_bytes'])} | "
                     f"{kib(r['peak_gathered_param_bytes'])} | {kib(r['peak_param_bytes'])} | "
                     f"{kib(r['target_bytes'])} | {'yes' if r['meets_target'] else 'NO'} | "
                     f"{kib(r['peak_total_bytes'])} | {kib(r['tracemalloc_step_peak_bytes'])} |")
    lines += [
        "",
        "Reading: full_shard without prefetch keeps one unit gathered at a time and meets the target; with "
        "backward prefetch the next unit's buffer is alive together with the current one (one extra unit, the "
        "price of overlap). shard_grad_op keeps every unit gathered from forward to backward and no_shard "
        "holds the whole model, so neither is meant to meet a 1/p target.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help="measure at the current world size (under mpiexec)")
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--d-hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows-dir", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="bench/results/fsdp_memory.md")
    args = ap.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
