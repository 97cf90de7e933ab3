"""torch DDP step time on the mpcomm backend with and without gradient compression hooks, and on gloo, in one job.

    ci/cluster.sh 2 1 1gbit -- bash -c 'OMP_NUM_THREADS=1 mpiexec -n 2 .venv-torch-2.14.1/bin/python \\
        bench/torch_ddp_hooks.py --out bench/results/compression_torch.md'

The same MLP (``--layers`` square Linear layers of ``--width``, ``--batch`` rows per rank, SGD) trained by one
DDP replica per configuration, all built up front: on mpcomm (the default group) with no hook, with torch's
``bf16_compress_hook`` and with mpcomm's ``wire_hook`` (bf16 without and with error feedback, int8 with); on gloo (a
``new_group(backend="gloo")`` over the same ranks) with no hook and with ``bf16_compress_hook``. Rounds are
interleaved: each round runs ``--steps`` steps of every configuration in turn, so a change of machine load
touches them all. A step starts after a barrier and counts as the slowest rank's time. Reported per
configuration: the median step over all rounds, the spread of the round medians (min-max), the speed-up against
mpcomm with no hook, and the loss after the last step.

torch's CPU builds (2.13.0+cpu) refuse ``bf16_compress_hook`` by name in DDP whatever the backend; there the same
function is registered under another name (``mpcomm.integrations.torch.hooks.bf16_compress_hook``) and the report says so.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one core per rank
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import mpcomm.integrations.torch.hooks as mpcomm_hooks  # noqa: E402  (registers the "mpcomm" backend)
from mpcomm.integrations.torch.hooks import TORCH_REFUSES_BF16_HOOK, WireState, wire_hook  # noqa: E402

WORLD = MPI.COMM_WORLD
BF16_HOOK = mpcomm_hooks.bf16_compress_hook if TORCH_REFUSES_BF16_HOOK else default_hooks.bf16_compress_hook


class Replica:
    """One configuration: a DDP model on ``group`` with ``hook`` (or none), its optimizer and data."""

    def __init__(self, name: str, group: Any, hook: Callable | None, state: Any, args: argparse.Namespace):
        self.name = name
        torch.manual_seed(args.seed)
        layers: list[torch.nn.Module] = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers[:-1])
        self.ddp = DistributedDataParallel(self.model, process_group=group)
        if hook is not None:
            self.ddp.register_comm_hook(state, hook)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(args.seed + 1 + WORLD.Get_rank())
        self.x = torch.randn(args.batch, args.width, generator=g)
        self.y = torch.randn(args.batch, args.width, generator=g)
        self.steps: list[float] = []
        self.round_medians: list[float] = []
        self.loss = float("nan")

    def step(self) -> float:
        """One training step after a barrier; the slowest rank's seconds."""
        WORLD.Barrier()
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.ddp(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        elapsed = time.perf_counter() - start
        self.loss = float(loss.detach())
        return WORLD.allreduce(elapsed, op=MPI.MAX)


def replicas(args: argparse.Namespace) -> list[Replica]:
    gloo = dist.new_group(backend="gloo") if dist.is_gloo_available() else None
    made = [Replica("mpcomm, no hook", None, None, None, args),
            Replica("mpcomm, torch bf16_compress_hook", None, BF16_HOOK, None, args),
            Replica("mpcomm, wire_hook bf16", None, wire_hook, WireState("bf16"), args),
            Replica("mpcomm, wire_hook bf16 + error feedback", None, wire_hook, WireState("bf16", error_feedback=True),
                    args),
            Replica("mpcomm, wire_hook int8 + error feedback", None, wire_hook, WireState("int8", error_feedback=True),
                    args)]
    if gloo is not None:
        made += [Replica("gloo, no hook", gloo, None, None, args),
                 Replica("gloo, torch bf16_compress_hook", gloo, BF16_HOOK, gloo, args)]
    return made


def report(args: argparse.Namespace, runs: list[Replica], load_before: str) -> str:
    params = sum(p.numel() for p in runs[0].model.parameters())
    base = float(np.median(runs[0].steps))
    lines = [
        "# torch DDP with gradient compression hooks: mpcomm and gloo",
        "",
        f"Command: `{' '.join(sys.argv)}` (run under ci/cluster.sh as the module docstring says when across nodes)",
        "",
        f"torch {torch.__version__}, {WORLD.Get_size()} ranks on {len(set(WORLD.allgather(MPI.Get_processor_name())))} "
        f"node(s), {platform.node()}; MLP {args.layers} x Linear({args.width}, {args.width}), {params} parameters "
        f"({params * 4 / 2**20:.1f} MiB of float32 gradients), batch {args.batch} rows per rank; {args.rounds} "
        f"interleaved rounds x {args.steps} steps after {args.warmup} warm-up steps per configuration.",
        f"Load average before: {load_before}; after: {_load()}."
        + (" bf16_compress_hook registered as mpcomm.integrations.torch.hooks.bf16_compress_hook (this CPU build's DDP refuses the name)."
           if TORCH_REFUSES_BF16_HOOK else ""),
        "",
        "| configuration | median step (ms) | round medians min-max (ms) | vs mpcomm, no hook | loss after |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        median = float(np.median(r.steps))
        lines.append(f"| {r.name} | {median * 1e3:.1f} | {min(r.round_medians) * 1e3:.1f}-"
                     f"{max(r.round_medians) * 1e3:.1f} | {base / median:.2f}x | {r.loss:.8f} |")
    return "\n".join(lines) + "\n"


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the report here (rank 0)")
    args = parser.parse_args(argv)
    load_before = _load()
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # the simulated cluster's NIC, else loopback
        os.environ["GLOO_SOCKET_IFNAME"] = "nic0" if os.path.exists("/sys/class/net/nic0") else "lo"
    torch.set_num_threads(1)
    dist.init_process_group("mpcomm")  # env:// (filled in from MPI): a TCP store, which gloo's group needs too
    runs = replicas(args)
    for r in runs:
        for _ in range(args.warmup):
            r.step()
    for _ in range(args.rounds):
        for r in runs:
            times = [r.step() for _ in range(args.steps)]
            r.steps += times
            r.round_medians.append(float(np.median(times)))
    text = report(args, runs, load_before)
    if WORLD.Get_rank() == 0:
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
