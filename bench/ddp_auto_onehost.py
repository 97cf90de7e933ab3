"""What ``compression="auto"`` costs where it stays off (one host): DDP steps with ``compression=None`` and with
``"auto"`` interleaved step by step in one process (same data, same shapes; the order swapped every step), so load
drifts hit both alike.

    OMP_NUM_THREADS=1 mpiexec -n 2 python bench/ddp_auto_onehost.py --steps 200 --repeats 5

Prints, per repeat, the median step of each and their ratio, then the median and range of the ratios, and what
auto chose per bucket (it must be "exact" everywhere on one host).
"""
from __future__ import annotations

import argparse
import statistics
import time

from mpi4py import MPI

import mpcomm.nn as nn
from mpcomm import Communicator
from mpcomm.parallel.ddp import DistributedDataParallel
from mpcomm.workload import Workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--d-hidden", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=8)
    args = ap.parse_args()
    comm = Communicator(MPI.COMM_WORLD)
    wl = Workload(num_layers=2, d_model=args.d_model, d_hidden=args.d_hidden, global_batch=args.global_batch,
                  dtype="float32")
    engines = {}
    for mode in (None, "auto"):
        ddp = DistributedDataParallel(wl.model(), comm, compression=mode, compression_warmup_steps=0)
        engines[str(mode)] = (ddp, nn.Adam(ddp.parameters(), lr=1e-3))
    ratios = []
    for rep in range(args.repeats):
        times: dict[str, list[float]] = {k: [] for k in engines}
        for step in range(args.steps):
            x, y = wl.local_batch(step, comm.rank, comm.size)
            order = list(engines) if step % 2 == 0 else list(reversed(engines))  # neither always goes first
            for name in order:
                ddp, opt = engines[name]
                comm.barrier()
                start = time.perf_counter()
                pred, ctx = ddp.forward(x)
                ddp.backward(nn.mse_loss(pred, y)[1], ctx)
                opt.step()
                ddp.zero_grad()
                times[name].append(time.perf_counter() - start)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ratios.append(med["auto"] / med["None"])
        if comm.rank == 0:
            print(f"repeat {rep}: none {med['None']:.2f} ms, auto {med['auto']:.2f} ms, auto/none {ratios[-1]:.4f}")
    if comm.rank == 0:
        ratios.sort()
        print(f"auto/none over {args.repeats} repeats of {args.steps} interleaved steps (rank 0): median "
              f"{statistics.median(ratios):.4f}, range [{ratios[0]:.4f}, {ratios[-1]:.4f}]; auto chose "
              f"{engines['auto'][0].compression_choices()}")
    comm.free()


if __name__ == "__main__":
    main()
