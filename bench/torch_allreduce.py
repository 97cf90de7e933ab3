"""``dist.all_reduce`` on the mpcomm backend against gloo and raw mpi4py, measured in one job.

    OMP_NUM_THREADS=1 timeout 900 mpiexec -n 2 python bench/torch_allreduce.py --out bench/results/torch_allreduce_p2.md

The default group is mpcomm's (``dist.init_process_group("mpcomm")``, env:// so that a gloo group can share its
store); a gloo group of the same ranks comes from ``dist.new_group(backend="gloo")``. Contenders, each an in-place
SUM all-reduce of a float32 tensor (or numpy array) of each size:

* ``mpi4py``  - raw ``MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)``;
* ``mpcomm``  - ``Communicator.allreduce`` on the default group's communicator (mpcomm without torch);
* ``dist/mpcomm`` - ``dist.all_reduce(t)`` on the default (mpcomm) group;
* ``dist/gloo``   - ``dist.all_reduce(t, group=gloo)``.

numpy asks the kernel for transparent huge pages for large arrays; torch's CPU allocator does so only with
``THP_MEM_ALLOC_ENABLE=1`` in the environment (read at its first allocation, so it must be set before Python
starts). Large all-reduces on 4 KiB pages run markedly slower here (TLB misses in MPI's copies and the
reductions), so the report says which the tensors had; ``mpcomm`` (numpy arrays) has huge pages either way. The
backend itself moves a large tensor it reduces a second time onto huge pages (``mpcomm/integrations/torch/pages.py``,
off with ``MPCOMM_TORCH_HUGEPAGES=0``); the tensors here are reused call after call, as DDP's buckets are.

A second table splits the 8 B call into its layers, each timed the same way: raw ``Allreduce``;
``Communicator.allreduce`` on a numpy array; what the backend runs: with its C++ extension
(``mpcomm/integrations/torch/native_allreduce.cpp``) the Communicator running the plan whose function is the C++
all-reduce of the tensor itself, else ``Communicator.allreduce`` on ``tensor.numpy()`` made per call; the group's
``allreduce`` method called directly (the backend's own cost added); ``dist.all_reduce`` (torch's).

For each size, ``--rounds`` rounds; in each round every contender (order rotated from round to round, so load
drift hits all alike) runs a block of calls after a barrier, the block's time being the slowest rank's. A block
is ``--calls`` calls for 8 B and as many calls as fill about ``--budget`` seconds for the large sizes (counted on
rank 0 from a warm-up, the same on every rank). Reported: the median block's time per call (min and max over the
rounds as the spread), busbw = size x 2(p-1)/p / time, and the ratios the targets are stated in: dist/mpcomm over
mpi4py at 8 B (target <= 3), dist/mpcomm busbw over dist/gloo's at >= 1 MiB (target >= 3).
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one core per rank
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpcomm.integrations.torch  # noqa: E402,F401  (registers the backend; fills in env:// variables)
from mpcomm.integrations.torch.pages import SWITCH  # noqa: E402

WORLD = MPI.COMM_WORLD
CONTENDERS = ("mpi4py", "mpcomm", "dist/mpcomm", "dist/gloo")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,1M,16M,64M", help="bytes per rank, comma separated (K/M suffixes)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=300, help="calls per block at sizes below 64 KiB")
    ap.add_argument("--budget", type=float, default=0.1, help="seconds per block at the larger sizes")
    ap.add_argument("--out", default=None, help="markdown report (rank 0)")
    ap.add_argument("--json", default=None, help="raw per-round times (rank 0)")
    return ap.parse_args(argv)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def contenders(nbytes: int, gloo) -> dict:
    """Fresh buffers for one size; each contender's call."""
    count = max(1, nbytes // 4)
    array = np.ones(count, dtype=np.float32)
    tensor = torch.ones(count, dtype=torch.float32)
    gloo_tensor = torch.ones(count, dtype=torch.float32)
    comm = dist.group.WORLD._get_backend(torch.device("cpu")).comm  # the mpcomm Backend's Communicator
    return {
        "mpi4py": lambda: WORLD.Allreduce(MPI.IN_PLACE, array, MPI.SUM),
        "mpcomm": lambda: comm.allreduce(array),
        "dist/mpcomm": lambda: dist.all_reduce(tensor),
        "dist/gloo": lambda: dist.all_reduce(gloo_tensor, group=gloo),
    }


def layers(nbytes: int) -> dict:
    """The 8 B call's layers, cheapest first (see the module docstring)."""
    count = max(1, nbytes // 4)
    array, tensor = np.ones(count, dtype=np.float32), torch.ones(count, dtype=torch.float32)
    group = dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))  # the mpcomm Backend torch bound to the group's cpu
    comm = backend.comm
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # what dist.all_reduce(t) passes
    out = {"mpi4py Allreduce": lambda: WORLD.Allreduce(MPI.IN_PLACE, array, MPI.SUM),
           "Communicator.allreduce(numpy)": lambda: comm.allreduce(array)}
    plan = backend._native_plan(tensor, opts) if backend._native_plan is not None else None
    if plan is not None:
        out["Communicator.run(the C++ plan, tensor)"] = lambda: comm.run(plan, tensor, plan.rop)
    else:
        out["Communicator.allreduce(tensor.numpy())"] = lambda: comm.allreduce(tensor.numpy(), "sum", "auto")
    out["BackendMpcomm.allreduce"] = lambda: backend.allreduce([tensor], opts)
    out["ProcessGroup.allreduce"] = lambda: group.allreduce([tensor], opts)
    out["dist.all_reduce"] = lambda: dist.all_reduce(tensor)
    return out


def block(call, n: int) -> float:
    """Seconds per call of ``n`` calls started together; the slowest rank's."""
    WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    return WORLD.allreduce(elapsed, op=MPI.MAX) / n


def calls_per_block(call, nbytes: int, args) -> int:
    if nbytes < 64 << 10:
        return args.calls
    per_call = block(call, 2)
    return WORLD.bcast(max(1, int(args.budget / per_call)) if WORLD.Get_rank() == 0 else None, root=0)


def measure(calls: dict, nbytes: int, args) -> dict[str, list[float]]:
    counts = {}
    for name, call in calls.items():
        block(call, 3)  # warm-up (plans, scratch buffers, connections)
        counts[name] = calls_per_block(call, nbytes, args)
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(block(calls[name], counts[name]))
    return times


def report(results: dict, p: int, args, load_before, load_after) -> str:
    factor = 2 * (p - 1) / p
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
    collapse = os.environ.get(SWITCH, "1") != "0"
    pages = ("on huge pages (THP_MEM_ALLOC_ENABLE=1)" if thp == "1" else
             "on 4 KiB pages, the backend moving reused large tensors onto huge pages" if collapse else
             f"on 4 KiB pages ({SWITCH}=0)")
    lines = [f"## {p} ranks, torch allocations {pages}",
             "",
             f"Command: `{'THP_MEM_ALLOC_ENABLE=1 ' if thp else ''}{'' if collapse else SWITCH + '=0 '}"
             f"OMP_NUM_THREADS=1 timeout 900 mpiexec -n {p} python "
             f"bench/torch_allreduce.py --sizes {args.sizes} --rounds {args.rounds} --calls {args.calls} "
             f"--budget {args.budget}`", "",
             f"Machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, torch "
             f"{torch.__version__}, {MPI.Get_library_version().splitlines()[0]}. Load average before "
             f"{' '.join(f'{x:.2f}' for x in load_before)}, after {' '.join(f'{x:.2f}' for x in load_after)}"
             + (" (above the core count: other jobs shared the cores, and the times are inflated and scattered)."
                if load_before[0] > os.cpu_count() else " (the job's own ranks count)."), "",
             "Median time per call over the rounds (min-max in brackets); busbw = size x 2(p-1)/p / time.", "",
             "| size | " + " | ".join(CONTENDERS) + " | dist/mpcomm / mpi4py | busbw mpcomm / gloo |",
             "|---:|" + "---:|" * (len(CONTENDERS) + 2)]
    for nbytes, times in results.items():
        med = {n: float(np.median(t)) for n, t in times.items()}
        cells = []
        for n in CONTENDERS:
            t = times[n]
            if nbytes < 64 << 10:
                cells.append(f"{med[n] * 1e6:.1f} us ({min(t) * 1e6:.1f}-{max(t) * 1e6:.1f})")
            else:
                bw = [nbytes * factor / x / 1e9 for x in t]
                cells.append(f"{nbytes * factor / med[n] / 1e9:.2f} GB/s ({min(bw):.2f}-{max(bw):.2f})")
        ratio = med["dist/mpcomm"] / med["mpi4py"]
        bw_ratio = med["dist/gloo"] / med["dist/mpcomm"]
        lines.append(f"| {_human(nbytes)} | " + " | ".join(cells) + f" | {ratio:.2f} | {bw_ratio:.2f} |")
    lines += ["", "Targets: dist/mpcomm <= 3 x mpi4py at 8 B; busbw of dist/mpcomm >= 3 x dist/gloo's at >= 1 MiB.", ""]
    return "\n".join(lines)


def layer_table(times: dict) -> str:
    """The 8 B call layer by layer: median (min) per call, and what each layer adds to the one before."""
    lines = ["", "8 B, layer by layer (median, min in brackets; added: over the layer above, medians):", "",
             "| layer | us per call | added us | x mpi4py |", "|---|---:|---:|---:|"]
    previous, raw = None, float(np.median(next(iter(times.values()))))
    for name, t in times.items():
        med = float(np.median(t))
        added = "" if previous is None else f"{(med - previous) * 1e6:+.2f}"
        lines.append(f"| {name} | {med * 1e6:.2f} ({min(t) * 1e6:.2f}) | {added} | {med / raw:.2f} |")
        previous = med
    return "\n".join(lines + [""])


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main(argv=None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("mpcomm", timeout=timedelta(seconds=300))  # env:// (a TCP store gloo can share)
    gloo = dist.new_group(backend="gloo")
    results = {}
    for size in args.sizes.split(","):
        nbytes = parse_size(size)
        results[nbytes] = measure(contenders(nbytes, gloo), nbytes, args)
        if WORLD.Get_rank() == 0:
            med = {n: np.median(t) * 1e6 for n, t in results[nbytes].items()}
            print(f"{_human(nbytes):>8}: " + "  ".join(f"{n} {v:.1f} us" for n, v in med.items()), flush=True)
    breakdown = measure(layers(8), 8, args)
    dist.destroy_process_group()
    if WORLD.Get_rank() == 0:
        text = report(results, WORLD.Get_size(), args, load_before, os.getloadavg()) + layer_table(breakdown)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"seconds_per_call": {str(k): v for k, v in results.items()}, "layers_8B": breakdown}, f,
                          indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
