"""Bytes each node's NIC sends per FSDP training step, full_shard against hybrid_shard, on the simulated cluster.

    ci/cluster.sh 2 2 1gbit -- mpiexec -n 4 python bench/cluster_fsdp_bytes.py --out bench/results/cluster_fsdp_bytes_2x2.md

full_shard shards every unit over all P ranks: per step it all-gathers the parameters twice (forward, and again
in backward after resharding) and reduce-scatters the gradients, all across nodes. hybrid_shard shards inside a
node and replicates across nodes: the gathers and the reduce-scatter stay on the node's shared memory and only
the all-reduce of each rank's gradient shard (1/q of the model) crosses the network. The counters are the nodes'
``/sys/class/net/nic0/statistics/tx_bytes`` around ``--steps`` steps (after a warm-up step), read with every rank
stopped at a barrier; the "ring estimate" is what ring all-gather / reduce-scatter / all-reduce would send
per node for M bytes of parameters (full_shard 3 (P-1)/P M, hybrid_shard 2 (N-1)/N M), for comparison.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.nn import TransformerMLPBlock, make_optimizer, mse_loss
from mpcomm.parallel.fsdp import FullyShardedDataParallel
from mpcomm.workload import Workload


def nic_bytes() -> int:
    with open("/sys/class/net/nic0/statistics/tx_bytes") as f:
        return int(f.read())


def measure(comm: Communicator, strategy: str, workload: Workload, steps: int) -> dict:
    engine = FullyShardedDataParallel(workload.model(), comm, sharding_strategy=strategy,
                                      auto_wrap_policy={TransformerMLPBlock})
    opt = make_optimizer("sgd", engine.parameters(), 0.01)

    def step(s: int) -> None:
        x, y = workload.local_batch(s, comm.rank, comm.size)
        engine.zero_grad()
        out, ctx = engine.forward(x)
        engine.backward(mse_loss(out, y)[1], ctx)
        opt.step()

    step(0)  # warm-up: connections, scratch buffers, the choices of auto
    comm.barrier()
    before = nic_bytes()
    comm.barrier()  # nobody sends before every node has read its counter
    start = time.perf_counter()
    for s in range(1, steps + 1):
        step(s)
    comm.barrier()
    seconds = (time.perf_counter() - start) / steps
    sent = (nic_bytes() - before) / steps
    per_node = comm.mpi.gather(sent if comm.node_rank == 0 else None, root=0)
    groups = {"world": comm}  # full_shard shards over the world itself
    for name, group in (("shard group", engine.groups.shard), ("replicate group", engine.groups.replicate)):
        if group is not None and group is not comm:
            groups[name] = group
    used = {f"{name} {op}": sorted(algs) for name, group in groups.items()
            for op, algs in group.stats().items() if op != "barrier"}
    return {"strategy": strategy, "bytes_per_node": [b for b in (per_node or []) if b is not None],
            "seconds_per_step": seconds, "algorithms": used}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--d-hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", help="write the markdown table here (rank 0)")
    args = parser.parse_args()
    comm = Communicator(MPI.COMM_WORLD)
    workload = Workload(num_layers=args.layers, d_model=args.d_model, d_hidden=args.d_hidden,
                        global_batch=8 * comm.size, seed=1, dtype="float32")
    model_bytes = sum(p.data.nbytes for p in workload.model().parameters())
    results = []
    for strategy in ("full_shard", "hybrid_shard"):
        comm.reset_stats()  # the world's; each engine's shard and replicate groups are new communicators
        results.append(measure(comm, strategy, workload, args.steps))
    if comm.rank != 0:
        return
    p, nodes = comm.size, comm.num_nodes
    estimate = {"full_shard": 3 * (p - 1) / p * model_bytes, "hybrid_shard": 2 * (nodes - 1) / nodes * model_bytes}
    lines = [f"FSDP on {nodes} nodes x {comm.node_size} ranks: {args.layers} x TransformerMLPBlock({args.d_model}, "
             f"{args.d_hidden}), float32, {model_bytes / 2**20:.2f} MiB of parameters; bytes each node's NIC sent "
             f"per step (mean of {args.steps} steps after a warm-up)", "",
             "| strategy | NIC bytes per step, per node (MiB) | / model bytes | ring estimate (MiB) | step (s) | "
             "algorithms auto ran |", "|---|---|---:|---:|---:|---|"]
    for r in results:
        worst = max(r["bytes_per_node"])
        algs = "; ".join(f"{op}: {', '.join(a)}" for op, a in sorted(r["algorithms"].items()))
        lines.append(f"| {r['strategy']} | {', '.join(f'{b / 2**20:.2f}' for b in r['bytes_per_node'])} | "
                     f"{worst / model_bytes:.2f} | {estimate[r['strategy']] / 2**20:.2f} | "
                     f"{r['seconds_per_step']:.3f} | {algs} |")
    full, hybrid = (max(r["bytes_per_node"]) for r in results)
    lines += ["", f"hybrid_shard / full_shard NIC bytes: {hybrid / full:.2f}", ""]
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
