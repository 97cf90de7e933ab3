"""The payload rate of one node's link on the simulated cluster, for the "link-bound" column of the sweeps.

    ci/cluster.sh 2 2 1gbit -- mpiexec -n 4 python bench/cluster_link.py --json link.json

The first ranks of node 0 and node 1 exchange 64 MiB both ways at once with raw mpi4py (``Sendrecv``; no
mpcomm code), ``--repeats`` times after a warm-up; the median exchange gives the bytes per second each direction
of a link carries while the other direction is busy too, which is what every node's NIC does in an all-reduce.
Rank 0 prints it and writes ``{"bytes_per_second": ..., "seconds": [...], "nbytes": ..., "nodes": N}``.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI


def measure(nbytes: int, repeats: int) -> dict:
    world = MPI.COMM_WORLD
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    nodes = world.allreduce(1 if node.Get_rank() == 0 else 0)
    leaders = world.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, world.Get_rank())
    in_pair = leaders != MPI.COMM_NULL and leaders.Get_rank() < 2
    pair = world.Split(0 if in_pair else MPI.UNDEFINED, world.Get_rank())  # first ranks of nodes 0 and 1
    seconds: list[float] = []
    if pair != MPI.COMM_NULL and pair.Get_size() == 2:
        peer = 1 - pair.Get_rank()
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        for i in range(repeats + 1):  # the first exchange is a warm-up (connections, pages, token bucket)
            pair.Barrier()
            begin = time.perf_counter()
            pair.Sendrecv(send, peer, 0, recv, peer, 0)
            if i:
                seconds.append(time.perf_counter() - begin)
    everyone = world.allgather(seconds)
    worst = [max(values) for values in zip(*[s for s in everyone if s])] if nodes >= 2 else []
    return {"nbytes": nbytes, "nodes": nodes, "seconds": worst,
            "bytes_per_second": nbytes / float(np.median(worst)) if worst else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=64 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the result here (rank 0)")
    args = parser.parse_args()
    result = measure(args.bytes, args.repeats)
    if MPI.COMM_WORLD.Get_rank() == 0:
        rate = result["bytes_per_second"]
        print(f"# link payload rate: {rate * 8 / 1e9:.3f} Gbit/s per direction ({args.bytes >> 20} MiB exchanged both "
              f"ways, median of {args.repeats}: {', '.join(f'{s * 1e3:.0f} ms' for s in result['seconds'])})",
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
