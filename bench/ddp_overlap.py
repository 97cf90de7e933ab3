"""DDP overlap benchmark: does bucketed all-reduce hide behind backward?

    OMP_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/ddp_overlap.py --out bench/results/ddp_overlap.md

Four measurements of one training step (forward + backward; no optimizer) of an MLP of ``--layers`` square
Linear layers of width ``--width`` on ``--batch`` rows per rank:

* forward alone - the bare module's forward only (what no DDP can overlap: buckets fill during backward);
* compute alone - the bare module, no communication (``zero_grad()`` frees the grads, so backward allocates and
  page-faults them again, as DDP's default mode does);
* compute alone, grads kept - the same with ``zero_grad(set_to_none=False)`` (grads stay allocated, as they do
  with ``gradient_as_bucket_view``);
* comm alone    - the same buckets all-reduced (``comm.iallreduce(op="avg")`` each, then wait) with no compute;
* overlapped    - ``DistributedDataParallel`` (buckets launched from the grad hooks during backward);
* delayed       - ``DistributedDataParallel(delay_all_reduce=True)`` (everything after backward);
* overlapped, gradient_as_bucket_view - the same as overlapped, but ``param.grad`` is a view into its bucket,
  so the gradients are not copied into the buckets and back (the copies the default mode has to make).

Target: overlapped <= 1.15 x max(compute, comm). The best any bucketed overlap can do is
forward + max(backward, comm) (the report's "ideal"): communication starts when the first bucket fills in
backward. On one host the all-reduce is CPU work on the cores backward uses; across hosts
(``ci/cluster.sh 2 1 1gbit -- mpiexec -n 2 python bench/ddp_overlap.py ...``, bench/cluster_ddp_overlap.sh) it is
mostly wire time.  Each number is the median over ``--iters`` steps, every step
started together after a barrier; the step time is the slowest rank's.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one core per rank
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpcomm.nn as nn  # noqa: E402
from mpcomm import Communicator  # noqa: E402
from mpcomm.parallel import DistributedDataParallel  # noqa: E402

from glibc_malloc import keep_freed_memory  # noqa: E402  (bench/glibc_malloc.py)

TARGET = 1.15


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="rows per rank")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--bucket-cap-mb", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None, help="write a markdown report here (rank 0)")
    ap.add_argument("--malloc-default", action="store_true",
                    help="leave glibc's malloc settings alone (freed grads go back to the OS and fault in again)")
    return ap.parse_args(argv)


def machine_busy_seconds() -> float:
    """CPU seconds every core of this machine has spent busy since boot (user, system, interrupts; /proc/stat)."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def timed(comm, modes, iters, warmup):
    """Run the modes round-robin (so load changes on a shared machine hit all of them alike); per mode the
    (median, min) over iterations of the slowest rank's time, and the median CPU seconds per step: of this
    rank's process (every thread of it) and of the whole machine (every process, the kernel's network stack too)."""
    times = {name: [] for name in modes}
    cpu = {name: [] for name in modes}
    for i in range(warmup + iters):
        for name, fn in modes.items():
            comm.barrier()
            c0, m0, t0 = time.process_time(), machine_busy_seconds(), time.perf_counter()
            fn()
            dt = np.array([time.perf_counter() - t0])
            used = (time.process_time() - c0, machine_busy_seconds() - m0)
            comm.allreduce(dt, op="max")
            if i >= warmup:
                times[name].append(float(dt[0]))
                cpu[name].append(used)
    return ({name: (float(np.median(t)), float(np.min(t))) for name, t in times.items()},
            {name: tuple(float(v) for v in np.median(np.array(c), axis=0)) for name, c in cpu.items()})


def main(argv=None):
    args = parse(argv)
    kept_memory = False if args.malloc_default else keep_freed_memory()
    comm = Communicator(MPI.COMM_WORLD, timeout=120)

    def build():
        return nn.mlp([args.width] * (args.layers + 1), activation="relu", seed=1, dtype=args.dtype)

    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((args.batch, args.width)).astype(args.dtype)
    gy = rng.standard_normal((args.batch, args.width)).astype(args.dtype) / x.size
    bare = build()
    kept = build()
    overlapped = DistributedDataParallel(build(), comm, bucket_cap_mb=args.bucket_cap_mb)
    delayed = DistributedDataParallel(build(), comm, bucket_cap_mb=args.bucket_cap_mb, delay_all_reduce=True)
    as_view = DistributedDataParallel(build(), comm, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
    buckets = [b.buffer for b in overlapped.buckets]

    def forward():
        bare.forward(x)

    def compute():
        y, ctx = bare.forward(x)
        bare.backward(gy, ctx)
        bare.zero_grad()

    def compute_kept():
        y, ctx = kept.forward(x)
        kept.backward(gy, ctx)
        kept.zero_grad(set_to_none=False)

    waits = {"overlapped (DDP)": [], "delay_all_reduce": [], "overlapped, gradient_as_bucket_view": []}

    def comm_only():
        works = [comm.iallreduce(b, op="avg") for b in buckets]
        for w in works:
            w.wait()

    def ddp_step(engine, name):
        def step():
            y, ctx = engine.forward(x)
            engine.backward(gy, ctx)
            waits[name].append(engine._reducer.wait_seconds)
            engine.zero_grad()
        return step

    load_before = os.getloadavg()[0]
    modes = {"forward alone": forward, "compute alone": compute, "compute alone, grads kept": compute_kept,
             "comm alone": comm_only,
             "overlapped (DDP)": ddp_step(overlapped, "overlapped (DDP)"),
             "delay_all_reduce": ddp_step(delayed, "delay_all_reduce"),
             "overlapped, gradient_as_bucket_view": ddp_step(as_view, "overlapped, gradient_as_bucket_view")}
    results, cpu = timed(comm, modes, args.iters, args.warmup)
    exposed = {name: float(np.median(w[args.warmup:])) for name, w in waits.items()}
    load_after = os.getloadavg()[0]

    if comm.rank != 0:
        return 0
    compute_t, comm_t = results["compute alone"][0], results["comm alone"][0]
    over_t, delay_t = results["overlapped (DDP)"][0], results["delay_all_reduce"][0]
    bound = max(compute_t, comm_t)
    ratio = over_t / bound
    forward_t = results["forward alone"][0]
    ideal = forward_t + max(compute_t - forward_t, comm_t)
    mpi_name = " ".join(MPI.Get_library_version().splitlines()[0].split())
    grad_mb = sum(b.nbytes for b in buckets) / 2**20
    kept_t = results["compute alone, grads kept"][0]
    view_t = results["overlapped, gradient_as_bucket_view"][0]
    lines = [
        "# DDP overlap benchmark",
        "",
        f"Command: `OMP_NUM_THREADS=1 timeout 600 mpiexec -n {comm.size} python bench/ddp_overlap.py "
        + " ".join(sys.argv[1:]) + "`",
        "",
        f"Machine: {platform.node()} / {os.cpu_count()} cores, {mpi_name}, "
        f"mpi4py {__import__('mpi4py').__version__}, numpy {np.__version__}; world {comm.size}.",
        f"Model: MLP of {args.layers} Linear({args.width}, {args.width}) + ReLU, {args.dtype}, {args.batch} rows "
        f"per rank; gradients {grad_mb:.2f} MiB in {len(buckets)} buckets (cap {args.bucket_cap_mb} MiB, "
        f"first bucket {overlapped.first_bucket_cap_mb} MiB). Step = forward + backward (+ gradient sync).",
        f"Median of {args.iters} steps after {args.warmup} warm-up steps, the modes interleaved step by "
        f"step; each step is the slowest rank's time. Load average (1 min) {load_before:.1f} before, "
        f"{load_after:.1f} after (other jobs shared the machine if it exceeds the rank count). glibc keeps freed "
        f"memory (bench/glibc_malloc.py): {kept_memory}.",
        "",
        "| measurement | median ms | min ms | exposed wait ms (median) | CPU ms, rank 0's process | CPU ms, machine |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (med, mn) in results.items():
        wait = f"{1e3 * exposed[name]:.2f}" if name in exposed else ""
        own, machine = cpu[name]
        lines.append(f"| {name} | {1e3 * med:.2f} | {1e3 * mn:.2f} | {wait} | {1e3 * own:.0f} | {1e3 * machine:.0f} |")
    verdict = "MET" if ratio <= TARGET else "NOT MET"
    lines += [
        "",
        f"- overlapped / max(compute, comm) = {over_t * 1e3:.2f} / {bound * 1e3:.2f} = **{ratio:.2f}** "
        f"(target <= {TARGET}: **{verdict}**)",
        f"- ideal (forward + max(backward, comm), what perfect overlap of bucketed gradients gives) = "
        f"{ideal * 1e3:.2f} ms = {ideal / bound:.2f} x max(compute, comm); overlapped / ideal = {over_t / ideal:.2f}",
        f"- delay_all_reduce / (compute + comm) = {delay_t / (compute_t + comm_t):.2f}; "
        f"overlapped saves {1e3 * (delay_t - over_t):.2f} ms per step vs delay_all_reduce "
        f"({(delay_t - over_t) / max(min(compute_t, comm_t), 1e-12):.0%} of the smaller of compute and comm, "
        f"the most overlap could save)",
        f"- overlapped with gradient_as_bucket_view / max(compute with grads kept, comm) = "
        f"{view_t * 1e3:.2f} / {max(kept_t, comm_t) * 1e3:.2f} = **{view_t / max(kept_t, comm_t):.2f}** (no gradient "
        f"copies into and out of the buckets, and grads that stay allocated: compare with compute that keeps "
        f"them too; against compute alone it is {view_t / bound:.2f})",
        f"- exposed wait = the time backward spends waiting for the all-reduces after its last layer "
        f"(`_reducer.wait_seconds`); comm alone takes {comm_t * 1e3:.2f} ms. Equal means nothing overlapped.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    from mpcomm.launch import run_main
    sys.exit(run_main(main))
