"""Differential soak: seeded random collectives across every collective x algorithm x dtype x communicator, each
checked against numpy, while the process's memory, file descriptors, threads and mpcomm's own tables are watched.

Every rank draws the same calls from one seeded generator (operation, algorithm, dtype, size, root, blocking or
not, which communicator: the world, its halves from ``split()``, a reversed ``split()``, and one simulating 2-rank
nodes so that ``hierarchical`` crosses "nodes"), and builds every rank's input from (seed, call, rank) — so each
rank computes the exact expected result of its own call with numpy, with no help from mpcomm. Inputs are small
integers in every dtype, so sums, products, min and max are exact and compared bit for bit (``avg``: within two
units in the last place). After every call the ranks exchange (over ``MPI.COMM_WORLD``, not mpcomm) whether their
result was right and a CRC of results that must be identical on every rank of a group.

    timeout 3600 mpiexec -n 4 python bench/soak.py --calls 20000 --json out.json     (make soak: p = 2, 3, 4)

``tests/test_soak.py`` runs a few hundred calls of the same driver in the normal suite.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
import zlib

import ml_dtypes
import numpy as np
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY
from mpcomm.settings import Settings
from mpcomm.trace import process_recorder

WORLD = MPI.COMM_WORLD
INTS = [np.dtype(t) for t in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")]
FLOATS = [np.dtype(t) for t in ("float16", "float32", "float64")] + [np.dtype(ml_dtypes.bfloat16)]
COMPLEX = [np.dtype("complex64"), np.dtype("complex128")]
BOOL = np.dtype(bool)
DTYPES = INTS + FLOATS + COMPLEX + [BOOL]
SIZES = [0, 1, 2, 3, 7, 13, 31, 97, 257, 1021, 4099, 16411]
LARGE = [65537, 262147]  # drawn now and then: rendezvous messages and the large-message algorithms
UNITS = [1, 31, 1021, 4099]  # all_to_all_v: elements per count of one sending rank
WARM_INDEX = 10**9  # the input seeds of warm_every_path's calls (apart from the random calls')
NONBLOCKING = ("allreduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "scatter",
               "all_to_all", "all_to_all_v")


def ops_for(dtype: np.dtype) -> list[str]:
    if dtype == BOOL:
        return ["min", "max"]
    if dtype in COMPLEX:
        return ["sum", "prod", "avg"]
    if dtype in INTS:
        return ["sum", "prod", "min", "max"]
    return ["sum", "prod", "min", "max", "avg"]


def values(rng: np.random.Generator, dtype: np.dtype, op: str | None, n: int) -> np.ndarray:
    """``n`` inputs whose reduction over up to 8 ranks is exact in ``dtype`` (small integers)."""
    if dtype == BOOL:
        return rng.random(n) < 0.5
    signed = dtype.kind in "fcV" or np.issubdtype(dtype, np.signedinteger)  # (bfloat16's kind is V)
    if op == "prod":
        pool = [-1, 1, 2] if signed else [1, 2]
        return rng.choice(pool, size=n).astype(dtype)
    low = -15 if signed else 0
    return rng.integers(low, 16, size=n).astype(dtype)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Soak:
    """The communicators and the running totals of one soak."""

    def __init__(self, seed: int, timeout: float = 60.0):
        self.seed = seed
        self.world = Communicator(WORLD, timeout=timeout)
        halves = self.world.split(self.world.rank % 2)
        reversed_ = self.world.split(0, key=-self.world.rank)
        nodes = Communicator(WORLD, timeout=timeout, ranks_per_node=2)
        self.comms = {"world": self.world, "halves": halves, "reversed": reversed_, "nodes-of-2": nodes}
        self.calls = self.wrong = 0
        self.failures: list[str] = []
        self.seen: set = set()

    def free(self) -> None:
        for c in self.comms.values():
            c.free()

    # -------------------------------------------------------------------------------- one call
    def step(self, index: int) -> None:
        draw = np.random.default_rng([self.seed, index])  # the same on every rank
        name = list(self.comms)[draw.integers(len(self.comms))]
        comm = self.comms[name]
        operation = sorted(REGISTRY)[draw.integers(len(REGISTRY))]
        algorithms = sorted(REGISTRY[operation]) + ["auto"]
        algorithm = algorithms[draw.integers(len(algorithms))]
        dtype = DTYPES[draw.integers(len(DTYPES))]
        reducing = operation in ("allreduce", "reduce_scatter", "reduce")
        op = ops_for(dtype)[draw.integers(len(ops_for(dtype)))] if reducing else None
        n = int(draw.choice(LARGE)) if draw.random() < 0.02 else int(draw.choice(SIZES))
        root = int(draw.integers(comm.size))
        blocking = draw.random() >= 0.25 or operation not in NONBLOCKING
        # all_to_all_v: rank i sends counts[i, j] elements to j, in amounts that differ between the ranks by up to
        # 10^4 (MoE routing), so that one rank's bytes alone would often make auto choose differently
        counts = draw.integers(0, 6, size=(comm.size, comm.size)) * draw.choice(UNITS, size=(comm.size, 1))
        self.call(index, name, operation, algorithm, dtype, op, n, root, blocking, counts)

    def warm_every_path(self) -> None:
        """Every (communicator, operation, algorithm), blocking and not, once at the largest size of the draw: each
        scratch buffer mpcomm keeps for reuse then has its final size, so the memory after this is what a job whose
        shapes vary within these bounds holds for good."""
        index = WARM_INDEX
        for name, comm in self.comms.items():
            for operation in sorted(REGISTRY):
                reducing = operation in ("allreduce", "reduce_scatter", "reduce")
                counts = np.full((comm.size, comm.size), 5 * max(UNITS))
                for algorithm in sorted(REGISTRY[operation]) + ["auto"]:
                    for blocking in (True, False) if operation in NONBLOCKING else (True,):
                        self.call(index, name, operation, algorithm, np.dtype("complex128"),
                                  "sum" if reducing else None, max(LARGE), 0, blocking, counts)
                        index += 1

    def fill_recorder(self) -> None:
        """As many barriers as the flight recorder keeps calls: from here on each call's entry replaces one of
        the same size, so that what the ring holds stops growing."""
        recorder = process_recorder(Settings.resolve().trace_buffer)  # (the one the Communicators made)
        for _ in range(recorder.capacity if recorder is not None else 0):
            self.world.barrier()

    def call(self, index, name, operation, algorithm, dtype, op, n, root, blocking, counts) -> None:
        """Run one call on every rank (each on its communicator ``name``), check it, count it."""
        comm = self.comms[name]
        label = f"call {index}: {operation}[{algorithm}] {dtype} n={n} op={op} root={root} on {name} " \
                f"({'blocking' if blocking else 'non-blocking'})"
        try:
            ok, crc = self._run(comm, operation, algorithm, dtype, op, n, root, blocking, counts, index)
            problem = None if ok else "wrong result"
        except Exception as exc:  # noqa: BLE001 - every rank reports it below
            ok, crc, problem = False, 0, f"{type(exc).__name__}: {exc}"
        everyone = WORLD.allgather((problem, crc, self._group(name)))
        group = [e for e in everyone if e[2] == self._group(name)]
        if operation in ("allreduce", "all_gather", "broadcast") and len({e[1] for e in group}) > 1:
            everyone[WORLD.Get_rank()] = (problem or "results differ between the ranks of its group", crc, group)
        self.calls += 1
        if any(e[0] for e in everyone):
            self.wrong += 1
            if len(self.failures) < 20:
                self.failures.append(f"{label}: " + "; ".join(f"rank {r}: {e[0]}" for r, e in enumerate(everyone)
                                                               if e[0]))
        self.seen.add((operation, algorithm, str(dtype), name))

    def _group(self, name: str) -> int:
        return self.world.rank % 2 if name == "halves" else 0

    def _inputs(self, index: int, dtype, op, n: int, rank: int) -> np.ndarray:
        """The input of ``rank`` in call ``index`` (any rank can make any rank's)."""
        return values(np.random.default_rng([self.seed, index, rank, 1]), dtype, op, n)

    def _run(self, comm, operation, algorithm, dtype, op, n, root, blocking, counts, index):
        p, r = comm.size, comm.rank
        per_rank = n * (p if operation in ("reduce_scatter", "scatter", "all_to_all") else 1)
        inputs = [self._inputs(index, dtype, op, per_rank, q) for q in range(p)]
        mine = inputs[r]
        call = getattr(comm, operation if blocking else "i" + operation)
        finish = (lambda w: w) if blocking else (lambda w: w.wait())
        if operation == "allreduce":
            buf = mine.copy()
            finish(call(buf, op, algorithm))
            return self._same(buf, _reduce(inputs, op, dtype)), zlib.crc32(buf.tobytes())
        if operation == "reduce_scatter":
            out = np.zeros(n, dtype)
            finish(call(mine, out, op, algorithm))
            return self._same(out, _reduce(inputs, op, dtype)[r * n : (r + 1) * n]), 0
        if operation == "reduce":
            out = np.zeros(n, dtype) if r == root else None
            finish(call(mine, out, op, root, algorithm))
            return r != root or self._same(out, _reduce(inputs, op, dtype)), 0
        if operation == "all_gather":
            out = np.zeros(n * p, dtype)
            finish(call(mine, out, algorithm))
            return np.array_equal(out, np.concatenate(inputs)), zlib.crc32(out.tobytes())
        if operation == "broadcast":
            buf = mine.copy()
            finish(call(buf, root, algorithm))
            return np.array_equal(buf, inputs[root]), zlib.crc32(buf.tobytes())
        if operation == "gather":
            out = np.zeros(n * p, dtype) if r == root else None
            finish(call(mine, out, root, algorithm))
            return r != root or np.array_equal(out, np.concatenate(inputs)), 0
        if operation == "scatter":
            out = np.zeros(n, dtype)
            finish(call(mine if r == root else None, out, root, algorithm))
            return np.array_equal(out, inputs[root][r * n : (r + 1) * n]), 0
        if operation == "all_to_all":
            out = np.zeros(n * p, dtype)
            finish(call(mine, out, algorithm))
            want = np.concatenate([inputs[q][r * n : (r + 1) * n] for q in range(p)])
            return np.array_equal(out, want), 0
        sizes = counts
        sends = [values(np.random.default_rng([self.seed, index, q, 2]), dtype, None, int(sizes[q].sum()))
                 for q in range(p)]
        out = np.zeros(int(sizes[:, r].sum()), dtype)
        finish(call(sends[r], sizes[r].tolist(), out, sizes[:, r].tolist(), algorithm))
        want = np.concatenate([sends[q][sizes[q, :r].sum() : sizes[q, : r + 1].sum()] for q in range(p)])
        return np.array_equal(out, want), 0

    @staticmethod
    def _same(got: np.ndarray, want: np.ndarray) -> bool:
        if got.dtype.kind in "fcV" and want.dtype != got.dtype:  # avg: rounded once, at most 2 ulp apart
            tolerance = 2 * float((np.finfo if got.dtype.kind == "c" else ml_dtypes.finfo)(got.dtype).eps)
            scale = np.maximum(np.abs(want), 1)
            return bool(np.all(np.abs(got.astype(want.dtype) - want) <= tolerance * scale))
        # Exact values; a zero's sign may differ (complex prod: the order of the products decides it).
        return got.shape == want.shape and bool(np.array_equal(got, want))


def _reduce(inputs: list[np.ndarray], op: str, dtype: np.dtype) -> np.ndarray:
    """numpy's reduction of the ranks' inputs: exact in int64 / float64 / complex128 (small integers), cast back;
    ``avg`` stays in float64 / complex128 (compared within a tolerance)."""
    if dtype == BOOL:
        stacked = np.stack(inputs)
        return stacked.all(axis=0) if op == "min" else stacked.any(axis=0)
    wide = np.complex128 if dtype.kind == "c" else np.float64 if dtype.kind in "fV" else np.int64
    if dtype == np.uint64:
        wide = np.uint64
    stacked = np.stack([x.astype(wide) for x in inputs])
    result = {"sum": stacked.sum(axis=0), "prod": stacked.prod(axis=0), "min": stacked.min(axis=0),
              "max": stacked.max(axis=0), "avg": stacked.sum(axis=0) / len(inputs)}[op]
    return result if op == "avg" else result.astype(dtype)


def scratch_bytes(comms) -> int:
    """The bytes of the scratch buffers mpcomm keeps for reuse (every transport of ``comms``, node parts too)."""
    return sum(c.footprint()["scratch_bytes"] for c in comms)


def run(calls: int, seed: int, warmup: int, report_every: int = 0, out=None, warm_paths: bool = False,
        passes: int = 1, traced: bool = False) -> dict:
    """``calls`` random calls, ``passes`` times over (after ``warm_every_path`` if ``warm_paths``); the footprint
    after ``warmup`` calls, at the end of each pass and at the end, each pass's peak RSS; mpcomm's table sizes and
    scratch bytes. With ``traced``, the footprint has the bytes Python and numpy hold (``tracemalloc``): exact where
    RSS depends on where the allocator put freed blocks, so a pass that repeats the one before shows what it
    leaked, to the byte."""
    soak = Soak(seed)
    start, after_warmup, peak_rss, samples = time.perf_counter(), None, 0, []
    pass_peaks: list[int] = []
    pass_ends: list[dict] = []

    def watch() -> dict:
        gc.collect()  # evicted plans are cyclic garbage until a full collection: count what is alive
        return {"rss": rss_bytes(), "fds": open_fds(), "threads": threading.active_count(),
                "scratch": scratch_bytes(soak.comms.values()), "python_blocks": sys.getallocatedblocks(),
                "traced": tracemalloc.get_traced_memory()[0] if traced else None}

    if traced:
        tracemalloc.start()
        soak.fill_recorder()  # (the ring's first round would count as growth)
    try:
        if warm_paths:
            soak.warm_every_path()
            if out is not None and WORLD.Get_rank() == 0:
                print(f"every path warmed: {soak.calls} calls, {soak.wrong} wrong, {watch()}, "
                      f"{time.perf_counter() - start:.0f} s", file=out, flush=True)
        done = 0
        for _ in range(passes):
            pass_peaks.append(0)
            for index in range(calls):
                soak.step(index)
                done += 1
                rss = rss_bytes()
                pass_peaks[-1] = max(pass_peaks[-1], rss)
                if done == warmup:
                    after_warmup = watch()
                if done >= warmup:
                    peak_rss = max(peak_rss, rss)
                if report_every and done % report_every == 0:
                    samples.append({"calls": done, **watch()})
                    if out is not None and WORLD.Get_rank() == 0:
                        now = samples[-1]
                        print(f"{done} calls, {soak.wrong} wrong, rss {now['rss'] / 2**20:.1f} MiB, scratch "
                              f"{now['scratch'] / 2**20:.1f} MiB, {_held(now)}python blocks {now['python_blocks']}, "
                              f"fds {now['fds']}, threads {now['threads']}, {time.perf_counter() - start:.0f} s",
                              file=out, flush=True)
            pass_ends.append(watch())
        end = pass_ends[-1] if pass_ends else watch()
        tables = {name: {key: count for key, count in c.footprint().items() if key != "scratch_bytes"}
                  for name, c in soak.comms.items()}
    finally:
        soak.free()
        if traced:
            tracemalloc.stop()
    return {"calls": soak.calls, "wrong": soak.wrong, "failures": soak.failures, "combinations": len(soak.seen),
            "after_warmup": after_warmup or end, "end": end, "peak_rss_after_warmup": peak_rss or end["rss"],
            "pass_peak_rss": pass_peaks, "pass_ends": pass_ends, "tables": tables,
            "seconds": time.perf_counter() - start, "samples": samples}


def _held(*footprints: dict) -> str:
    """What Python and numpy held at these footprints, where ``run(traced=True)`` counted it."""
    if footprints[0]["traced"] is None:
        return ""
    return "traced " + " -> ".join(f"{f['traced'] / 2**20:.2f}" for f in footprints) + " MiB, "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--warmup", type=int, default=None, help="calls before the footprint baseline (calls/5)")
    parser.add_argument("--report-every", type=int, default=1000)
    parser.add_argument("--json", default=None, help="rank 0 writes every rank's summary here")
    parser.add_argument("--rss-bound-mib", type=float, default=48.0,
                        help="fail if a rank's RSS grows more than this after the warm-up")
    parser.add_argument("--traced", action="store_true",
                        help="also count the bytes Python and numpy hold (tracemalloc: exact, but ~2x slower)")
    parser.add_argument("--no-warm-paths", dest="warm_paths", action="store_false",
                        help="skip the warm-up of every path at the largest size (Soak.warm_every_path)")
    args = parser.parse_args()
    summary = run(args.calls, args.seed, args.warmup or max(1, args.calls // 5), args.report_every, sys.stdout,
                  args.warm_paths, traced=args.traced)
    everyone = WORLD.gather(summary)
    if WORLD.Get_rank() == 0:
        for r, s in enumerate(everyone):
            grown = (s["peak_rss_after_warmup"] - s["after_warmup"]["rss"]) / 2**20
            print(f"rank {r}: {s['calls']} calls, {s['wrong']} wrong, {s['combinations']} combinations, "
                  f"rss after warm-up {s['after_warmup']['rss'] / 2**20:.1f} MiB, peak after "
                  f"{s['peak_rss_after_warmup'] / 2**20:.1f} (+{grown:.2f}), end {s['end']['rss'] / 2**20:.1f}; "
                  f"{_held(s['after_warmup'], s['end'])}fds {s['after_warmup']['fds']} -> "
                  f"{s['end']['fds']}; threads {s['after_warmup']['threads']} -> {s['end']['threads']}; "
                  f"tables {s['tables']}; {s['seconds']:.0f} s")
            for failure in s["failures"]:
                print("  ", failure)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": sys.argv, "world": WORLD.Get_size(), "ranks": everyone}, f, indent=1)
    problems = [f"rank {r}: {what}" for r, s in enumerate(everyone or []) for what in verdict(s, args.rss_bound_mib)]
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
    sys.exit(1 if WORLD.bcast(bool(problems)) else 0)


def verdict(summary: dict, rss_bound_mib: float) -> list[str]:
    """What is wrong with one rank's soak: wrong results, RSS growth after the warm-up, fds or threads changed."""
    before, end = summary["after_warmup"], summary["end"]
    grown = (summary["peak_rss_after_warmup"] - before["rss"]) / 2**20
    return ([f"{summary['wrong']} wrong"] * bool(summary["wrong"])
            + [f"RSS grew {grown:.1f} MiB after the warm-up (bound {rss_bound_mib:g})"] * (grown > rss_bound_mib)
            + [f"fds {before['fds']} -> {end['fds']}"] * (end["fds"] != before["fds"])
            + [f"threads {before['threads']} -> {end['threads']}"] * (end["threads"] != before["threads"]))


if __name__ == "__main__":
    main()
