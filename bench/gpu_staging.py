"""Host-staged CuPy all-reduce vs host numpy all-reduce of the same size (the cost of staging).

    mpirun -n 2 python bench/gpu_staging.py [--sizes 16M,64M,256M] [--algorithms ring,rhd,native]
                                            [--iters 10] [--warmup 2] [--json FILE]

For every size and algorithm it times ``comm.allreduce`` (op sum, float32) on a numpy array and on a CuPy
array of the same bytes; with an MPI that is not CUDA-aware the CuPy one goes through
``mpcomm.staging.StagedTransport`` (pinned host chunks, copies overlapped with MPI, reductions on the GPU).
Each time is the median over iterations of the slowest rank; before each iteration the buffer is reset
from a pristine copy outside the timed region. ``wrong`` counts elements where the CuPy result differs
bitwise from the numpy result (inputs are small integers, so sums are exact). ``d2h_GBps`` is one
device-to-host copy of the buffer into pinned memory, for scale. Needs CuPy and a GPU (one per rank is
best; ranks share GPU ``rank % count`` otherwise).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import mpcomm
from mpcomm import staging


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().rstrip("b")
    scale = units.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in units else text) * scale)


def timed(world, body, reset, sync, iters: int, warmup: int) -> float:
    """Median over ``iters`` of the slowest rank's seconds for ``body()`` (``reset()`` untimed before each)."""
    samples = []
    for i in range(warmup + iters):
        reset()
        sync()
        world.Barrier()
        start = time.perf_counter()
        body()
        sync()
        elapsed = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
        if i >= warmup:
            samples.append(elapsed)
    return float(np.median(samples))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16M,64M,256M", help="message sizes in bytes (k/M/G suffixes)")
    parser.add_argument("--algorithms", default="ring,rhd,native")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="write the rows to this file (rank 0)")
    args = parser.parse_args(argv)

    import cupy

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
    comm = mpcomm.Communicator(world)
    aware, reason = mpcomm.cuda_aware(explain=True)
    sync = cupy.cuda.get_current_stream().synchronize
    rows = []
    if rank == 0:
        print(f"# {p} ranks, GPU {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
              f"CUDA-aware: {aware} ({reason}); staging chunk {staging.chunk_bytes()} B")
        print(f"{'bytes':>11} {'algorithm':>9} {'host_ms':>9} {'cupy_ms':>9} {'ratio':>6} "
              f"{'host_busbw':>10} {'cupy_busbw':>10} {'d2h_GBps':>8} {'wrong':>6}")
    for nbytes in map(parse_size, args.sizes.split(",")):
        count = nbytes // 4
        rng = np.random.default_rng(rank)
        pristine = rng.integers(-8, 9, size=count).astype(np.float32)
        pristine_d = cupy.asarray(pristine)
        host, device = pristine.copy(), pristine_d.copy()

        copier = staging.CudaCopier(device.device.id)
        pinned = copier.pinned(device.nbytes)
        copier.to_host(pinned, device).synchronize()
        start = time.perf_counter()
        copier.to_host(pinned, device).synchronize()
        d2h = device.nbytes / (time.perf_counter() - start) / 1e9

        def reset_host():
            host[...] = pristine

        def reset_device():
            device[...] = pristine_d

        factor = 2 * (p - 1) / p
        for algorithm in args.algorithms.split(","):
            t_host = timed(world, lambda: comm.allreduce(host, algorithm=algorithm), reset_host, lambda: None,
                           args.iters, args.warmup)
            t_dev = timed(world, lambda: comm.allreduce(device, algorithm=algorithm), reset_device, sync,
                          args.iters, args.warmup)
            wrong = int(np.count_nonzero(cupy.asnumpy(device).view(np.uint32) != host.view(np.uint32)))
            wrong = world.allreduce(wrong, op=MPI.SUM)
            row = {
                "bytes": nbytes, "count": count, "dtype": "float32", "op": "sum", "algorithm": algorithm,
                "ranks": p, "cuda_aware": aware, "host_us": t_host * 1e6, "cupy_us": t_dev * 1e6,
                "ratio": t_dev / t_host, "host_busbw": factor * nbytes / t_host / 1e9,
                "cupy_busbw": factor * nbytes / t_dev / 1e9, "d2h_GBps": d2h, "wrong": wrong,
            }
            rows.append(row)
            if rank == 0:
                print(f"{nbytes:>11} {algorithm:>9} {t_host * 1e3:>9.2f} {t_dev * 1e3:>9.2f} {row['ratio']:>6.2f} "
                      f"{row['host_busbw']:>10.2f} {row['cupy_busbw']:>10.2f} {d2h:>8.1f} {wrong:>6}")
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    comm.free()
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
