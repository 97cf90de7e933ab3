"""DDP overlap benchmark: does bucketed all-reduce hide behind backward?

    OMP_NUM_THREADS=1 timeout 600 mpiexec -n 2 python bench/ddp_overlap.py --out bench/results/ddp_overlap.md

Four measurements of one training step (forward + backward; no optimizer) of an MLP of ``--layers`` square
Linear layers of width ``--width`` on ``--batch`` rows per rank:

* compute alone - the bare module, no communication;
* comm alone    - the same buckets all-reduced (``comm.iallreduce(op="avg")`` each, then wait) with no compute;
* overlapped    - ``DistributedDataParallel`` (buckets launched from the grad hooks during backward);
* delayed       - ``DistributedDataParallel(delay_all_reduce=True)`` (everything after backward);
* overlapped, gradient_as_bucket_view - the same as overlapped, but ``param.grad`` is a view into its bucket,
  so the gradients are not copied into the buckets and back (the copies the default mode has to make).

Target: overlapped <= 1.15 x max(compute, comm).  Each number is the median over ``--iters`` steps, every step
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
    return ap.parse_args(argv)


def timed(comm, modes, iters, warmup):
    """Run the modes round-robin (so load changes on a shared machine hit all of them alike); per mode the
    (median, min) over iterations of the slowest rank's time."""
    times = {name: [] for name in modes}
    for i in range(warmup + iters):
        for name, fn in modes.items():
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            dt = np.array([time.perf_counter() - t0])
            comm.allreduce(dt, op="max")
            if i >= warmup:
                times[name].append(float(dt[0]))
    return {name: (float(np.median(t)), float(np.min(t))) for name, t in times.items()}


def main(argv=None):
    args = parse(argv)
    comm = Communicator(MPI.COMM_WORLD, timeout=120)

    def build():
        return nn.mlp([args.width] * (args.layers + 1), activation="relu", seed=1, dtype=args.dtype)

    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((args.batch, args.width)).astype(args.dtype)
    gy = rng.standard_normal((args.batch, args.width)).astype(args.dtype) / x.size
    bare = build()
    overlapped = DistributedDataParallel(build(), comm, bucket_cap_mb=args.bucket_cap_mb)
    delayed = DistributedDataParallel(build(), comm, bucket_cap_mb=args.bucket_cap_mb, delay_all_reduce=True)
    as_view = DistributedDataParallel(build(), comm, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
    buckets = [b.buffer for b in overlapped.buckets]

    def compute():
        y, ctx = bare.forward(x)
        bare.backward(gy, ctx)
        bare.zero_grad()

    def comm_only():
        works = [comm.iallreduce(b, op="avg") for b in buckets]
        for w in works:
            w.wait()

    def ddp_step(engine):
        def step():
            y, ctx = engine.forward(x)
            engine.backward(gy, ctx)
            engine.zero_grad()
        return step

    load_before = os.getloadavg()[0]
    results = timed(comm, {"compute alone": compute, "comm alone": comm_only,
                           "overlapped (DDP)": ddp_step(overlapped), "delay_all_reduce": ddp_step(delayed),
                           "overlapped, gradient_as_bucket_view": ddp_step(as_view)},
                    args.iters, args.warmup)
    load_after = os.getloadavg()[0]

    if comm.rank != 0:
        return 0
    compute_t, comm_t = results["compute alone"][0], results["comm alone"][0]
    over_t, delay_t = results["overlapped (DDP)"][0], results["delay_all_reduce"][0]
    bound = max(compute_t, comm_t)
    ratio = over_t / bound
    mpi_name = " ".join(MPI.Get_library_version().splitlines()[0].split())
    grad_mb = sum(b.nbytes for b in buckets) / 2**20
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
        f"{load_after:.1f} after (other jobs shared the machine if it exceeds the rank count).",
        "",
        "| measurement | median ms | min ms |",
        "|---|---:|---:|",
    ]
    for name, (med, mn) in results.items():
        lines.append(f"| {name} | {1e3 * med:.2f} | {1e3 * mn:.2f} |")
    verdict = "MET" if ratio <= TARGET else "NOT MET"
    lines += [
        "",
        f"- overlapped / max(compute, comm) = {over_t * 1e3:.2f} / {bound * 1e3:.2f} = **{ratio:.2f}** "
        f"(target <= {TARGET}: **{verdict}**)",
        f"- delay_all_reduce / (compute + comm) = {delay_t / (compute_t + comm_t):.2f}; "
        f"overlapped saves {1e3 * (delay_t - over_t):.2f} ms per step vs delay_all_reduce "
        f"({(delay_t - over_t) / max(min(compute_t, comm_t), 1e-12):.0%} of the smaller of compute and comm, "
        f"the most overlap could save)",
        f"- overlapped with gradient_as_bucket_view / max(compute, comm) = "
        f"{results['overlapped, gradient_as_bucket_view'][0] / bound:.2f} (no gradient copies into and out of "
        f"the buckets)",
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
