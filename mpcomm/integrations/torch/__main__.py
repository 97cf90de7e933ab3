"""``mpiexec -n P python -m mpcomm.integrations.torch``: DDP step time on mpcomm vs gloo, in one job."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from . import gloo_init_args, init_process_group


def _time_ddp(steps: int, warmup: int, width: int, seed: int) -> tuple[float, list[float]]:
    """Median seconds per DDP training step of an MLP on the current default group, and the losses."""
    import time

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    x, y = torch.randn(64, width, generator=generator), torch.randn(64, 1, generator=generator)
    times, losses = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
        losses.append(float(loss.detach()))
    return float(np.median(times)), losses


def main(argv=None) -> int:
    """``mpiexec -n P python -m mpcomm.integrations.torch``: DDP step time on mpcomm vs gloo, same job."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=1024, help="MLP width (3 layers, ~2*width^2 parameters)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    world = MPI.COMM_WORLD
    torch.set_num_threads(1)
    results = {}
    init_process_group()
    results["mpcomm"] = _time_ddp(args.steps, args.warmup, args.width, args.seed)
    dist.destroy_process_group()
    if dist.is_gloo_available():
        dist.init_process_group("gloo", **gloo_init_args())
        results["gloo"] = _time_ddp(args.steps, args.warmup, args.width, args.seed)
        dist.destroy_process_group()
    if world.Get_rank() == 0:
        params = 2 * args.width * args.width + 2 * args.width + args.width + 1
        print(f"DDP step time, {world.Get_size()} ranks, MLP width {args.width} ({params} parameters, "
              f"{params * 4 / 2**20:.1f} MiB of gradients), median of {args.steps} steps:")
        for name, (seconds, losses) in results.items():
            print(f"  {name:7s} {seconds * 1e3:8.2f} ms/step   final loss {losses[-1]:.6f}")
        if "gloo" in results:
            same = results["gloo"][1] == results["mpcomm"][1]
            print(f"  loss trajectories identical: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
