"""mpcomm-bench: the driver in-process at any world size, its arithmetic, its flags and its launcher.

    timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_bench.py   (N = 1..4)
    python -m pytest -q tests/test_bench.py                                                (serial parts)
"""
from __future__ import annotations

import io
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from conftest import dtype_op_pairs, mpiexec_path, serial_only
from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY
from mpcomm.bench import COLLECTIVES, busbw_factor, run
from mpcomm.bench.base import RAW, count_wrong, rank_input, reference_reduce, sentinel_like, steady_input
from mpcomm.bench.cli import DTYPES, parse_size
from mpcomm.bench.driver import BLOCK_SECONDS, block_calls, calibrate, sizes
from mpcomm.bench.report import plot

CONTRACT_KEYS = {"size", "count", "dtype", "op", "algorithm", "time_us", "algbw", "busbw", "wrong"}
QUICK = ["-b", "8", "-e", "2K", "-f", "16", "-w", "1", "-n", "2", "--check"]
OPS = sorted(COLLECTIVES)


def bench(*argv, comm=None):
    out = io.StringIO()
    rows = run(list(argv), comm=comm, out=out)
    return rows, out.getvalue()


# ---------------------------------------------------------------- every op, every world size, --check
@pytest.mark.mpi
@pytest.mark.parametrize("operation", OPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float64"])
def test_check_reports_zero_wrong(operation, dtype):
    p = MPI.COMM_WORLD.Get_size()
    rows, text = bench("--op", operation, "--dtype", dtype, "--root", str(p - 1), *QUICK)
    assert rows, "no rows"
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["identical"] in (True, None), row
    assert {r["algorithm"] for r in rows} == set(COLLECTIVES[operation].algorithms()) | {RAW}
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "wrong elements in total: 0" in text and "OK" in text


@pytest.mark.mpi
@pytest.mark.parametrize("rounds, iters, warmup", [(1, 4, 1), (3, 4, 5), (3, 2, 0), (5, 1, 1)])
def test_rounds_time_blocks_within_the_call_cap(rounds, iters, warmup):
    """Every round times one block of at most -n calls (exactly -n with -w 0), and every row a positive time."""
    rows, text = bench("-b", "64", "-e", "4K", "-f", "64", "-w", str(warmup), "-n", str(iters), "--rounds", str(rounds),
                       "--algorithms", "ring,rhd,native,auto")
    assert rows and all(1 <= r["block"] <= iters and r["iters"] == rounds * r["block"] and r["time_us"] > 0
                        for r in rows), rows
    assert all(r["warmup"] >= warmup for r in rows), rows
    if warmup == 0:
        assert all(r["block"] == iters and r["warmup"] == 0 for r in rows), rows
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert f"{rounds} round-robin rounds" in text


@pytest.mark.mpi
@pytest.mark.parametrize("warmup, iters", [(0, 7), (1, 1), (5, 1000), (40, 3)])
def test_calibration_warms_up_and_caps_the_block(warmup, iters):
    world = MPI.COMM_WORLD
    calls = []
    block, made = calibrate(lambda: calls.append(1), world, warmup, iters, budget=1.0)
    assert made == len(calls) >= warmup
    assert 1 <= block <= iters
    if warmup == 0:
        assert (block, made) == (iters, 0)
    assert world.allgather((block, made)) == [(block, made)] * world.Get_size()  # every rank agrees


@pytest.mark.mpi
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("redops", ["sum,avg", "prod,min,max"])
def test_check_path_is_warning_free_for_every_dtype_and_op(redops):
    """Many timed calls of an in-place all-reduce and the check, on every dtype, warnings as errors: the timing
    data must not grow. Sums of the check inputs grow by p per call (float16 overflowed after ~6 calls at p = 2,
    float32 after ~120): -n gives 2**130 of growth at this p; products of them go to the p-th power per call:
    12 calls overflow every float. (float64 sums need ~1000 calls: test_timing_data_is_a_fixed_point... covers
    them without the time.)"""
    p = MPI.COMM_WORLD.Get_size()
    if p == 1:
        calls = 2  # an all-reduce over one rank is the identity: nothing can grow
    else:
        calls = math.ceil(130 / math.log2(p)) if redops == "sum,avg" else 12
    rows, _ = bench("--op", "allreduce", "--dtype", "all", "--redop", redops, "-b", "24", "-e", "24", "-w", "0",
                    "-n", str(calls), "--rounds", "1", "--algorithms", "ring", "--check", "--timeout", "20")
    assert {r["dtype"] for r in rows} == set(DTYPES) - ({"bool"} if redops == "sum,avg" else set())
    bad = [r for r in rows if r["wrong"] != 0 or r["identical"] is False]
    assert not bad, bad[:3]


@pytest.mark.mpi
@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("operation, algorithms", [("allreduce", "ring,rhd,native"),
                                                   ("reduce_scatter", "ring,rhd,native"), ("reduce", "tree,rhd,native")])
def test_check_every_dtype_and_redop(operation, algorithms):
    rows, _ = bench("--op", operation, "--dtype", "all", "--redop", "all", "-b", "24", "-e", "24", "-w", "0", "-n", "1",
                    "--check", "--algorithms", algorithms, "--root", str(MPI.COMM_WORLD.Get_size() - 1))
    assert {r["dtype"] for r in rows} >= {"float16", "bfloat16", "complex64", "uint8", "bool"}
    assert {r["op"] for r in rows} == {"sum", "prod", "min", "max", "avg"}
    bad = [r for r in rows if r["wrong"] != 0 or r["identical"] is False]
    assert not bad, bad[:3]



@pytest.mark.mpi
def test_check_catches_a_broken_algorithm(monkeypatch):
    comm = Communicator(MPI.COMM_WORLD)  # built before "broken" exists, so its selector never picks it

    def broken(t, buf, op):  # no communication, and the last rank corrupts one element
        if t.rank == t.size - 1:
            buf[0] += 1

    monkeypatch.setitem(REGISTRY["allreduce"], "broken", broken)
    try:
        rows, _ = bench("--algorithms", "broken", "-b", "64", "-e", "64", "-w", "0", "-n", "1", "--check", comm=comm)
    finally:
        comm.free()
    row = next(r for r in rows if r["algorithm"] == "broken")
    native = next(r for r in rows if r["algorithm"] == "native")
    assert native["wrong"] == 0
    assert row["wrong"] >= 1
    if comm.size > 1:
        assert row["identical"] is False


@pytest.mark.mpi
def test_json_rows_and_plot(tmp_path_factory):
    """--json writes the contract's keys; --plot draws one labelled line per algorithm and the memcpy ceiling
    (an SVG through the CLI, whose text labels can be read back, and a PNG from the same rows)."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib: install the [plot] extra (make does)")
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("bench")) if world.Get_rank() == 0 else None)
    path_json, path_svg = os.path.join(folder, "rows.json"), os.path.join(folder, "bw.svg")
    rows, text = bench("--op", "all_gather", "--json", path_json, "--plot", path_svg, *QUICK)
    world.Barrier()
    if world.Get_rank() == 0:
        written = json.loads(Path(path_json).read_text())
        assert isinstance(written, list) and len(written) == len(rows)
        for row in written:
            assert CONTRACT_KEYS <= set(row)
            assert row["busbw"] == pytest.approx(row["algbw"] * (world.Get_size() - 1) / world.Get_size())
            assert row["algbw"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9)
            assert row["size"] == row["count"] * world.Get_size() * 4  # float32, count per rank (nccl-tests)
        assert "memcpy" in text and "MPI library" in text and "vs_native" in text and "overhead" in text
        svg = Path(path_svg).read_text()
        labels = {r["algorithm"] for r in rows}
        assert labels == set(COLLECTIVES["all_gather"].algorithms()) | {RAW}
        for label in labels:  # matplotlib's SVG writes each text it draws as a comment
            assert f"<!-- {label} -->" in svg, label
        assert "<!-- memcpy" in svg
        path_png = os.path.join(folder, "bw.png")
        plot(rows, path_png, {"operation": "all_gather", "ranks": world.Get_size(), "nodes": 1, "dtypes": ["float32"],
                              "redops": ["none"], "memcpy_GBps": 1.0})
        from matplotlib.image import imread

        assert Path(path_png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert imread(path_png).shape == (600, 960, 4)  # 8 x 5 inches at 120 dpi


@pytest.mark.mpi
def test_vs_native_overhead_and_auto_rows():
    rows, text = bench("-b", "1K", "-e", "1K", "-w", "1", "-n", "2")
    native = next(r for r in rows if r["algorithm"] == "native")
    raw = next(r for r in rows if r["algorithm"] == RAW)
    assert [r["algorithm"] for r in rows][:2] == [RAW, "native"]
    assert native["vs_native"] == pytest.approx(1.0) and raw["overhead"] == pytest.approx(1.0)
    for row in rows:
        assert row["vs_native"] == pytest.approx(native["time_us"] / row["time_us"])
        assert row["overhead"] == pytest.approx(row["time_us"] / raw["time_us"])
        assert row["wrong"] is None  # not checked without --check
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "MPI.Comm.Allreduce(IN_PLACE)" in text and "median overhead over mpi4py-raw" in text
    auto = next(r for r in rows if r["algorithm"] == "auto")
    assert auto["resolved"] is None or auto["resolved"] in REGISTRY["allreduce"]


# ---------------------------------------------------------------- reduce, gather, scatter, alltoall
# nccl-tests' definitions (src/reduce.cu, gather.cu, scatter.cu, alltoall.cu): busbw factor, and whether "count" is
# per rank (per peer for alltoall; "size" is then the full buffer: count * p elements) or the whole vector.
NCCL_TESTS = {  # --op: (Communicator operation, busbw factor for p ranks, count per rank)
    "reduce": ("reduce", lambda p: Fraction(1), False),
    "gather": ("gather", lambda p: Fraction(p - 1, p), True),
    "scatter": ("scatter", lambda p: Fraction(p - 1, p), True),
    "alltoall": ("all_to_all", lambda p: Fraction(p - 1, p), True),
}
# where each operation's algorithms write their result: the index of the output among (t, *args)'s args
_OUTPUT_ARG = {"reduce": 1, "gather": 1, "scatter": 1, "all_to_all": 3}


@pytest.mark.mpi
@pytest.mark.parametrize("operation", sorted(NCCL_TESTS))
def test_rooted_and_alltoall_rows_json_and_what_ran(operation, tmp_path_factory):
    """--op reduce|gather|scatter|alltoall at the last rank as root: one row per size for every registered
    algorithm, auto and the raw mpi4py call, all checked right against numpy; nccl-tests' size, count and busbw;
    --json writes the same rows; every row ran the Communicator's operation with the algorithm it names."""
    world = MPI.COMM_WORLD
    p, rank = world.Get_size(), world.Get_rank()
    name, factor, per_rank = NCCL_TESTS[operation]
    folder = world.bcast(str(tmp_path_factory.mktemp("bench")) if rank == 0 else None)
    path = os.path.join(folder, f"{operation}.json")
    comm = Communicator(world)
    try:
        rows, text = bench("--op", operation, "--root", str(p - 1), "-b", "8", "-e", "4K", "-f", "8", "-w", "1",
                           "-n", "2", "--check", "--json", path, comm=comm)
        ran = set(comm.stats().get(name, {}))
    finally:
        comm.free()
    timed = sorted(REGISTRY[name]) + ["auto", RAW]
    sizes = sorted({r["size"] for r in rows})
    assert len(sizes) == 4 and len(rows) == len(sizes) * len(timed), [(r["size"], r["algorithm"]) for r in rows]
    for size in sizes:
        assert sorted(r["algorithm"] for r in rows if r["size"] == size) == sorted(timed), size
    for row in rows:
        assert CONTRACT_KEYS <= set(row), row
        assert row["collective"] == operation and row["dtype"] == "float32", row
        assert row["wrong"] == 0 and row["identical"] is None, row  # per-rank results: compared to numpy only
        assert row["size"] == row["count"] * 4 * (p if per_rank else 1), row
        assert row["busbw"] == pytest.approx(row["algbw"] * float(factor(p))), row
        assert row["root"] == (None if operation == "alltoall" else p - 1), row
    raw = [r for r in rows if r["algorithm"] == RAW]
    assert all(r["overhead"] == pytest.approx(1.0) for r in raw), raw
    assert ran == set(REGISTRY[name]), ran  # the fixed rows ran their own algorithms (auto's choice is one of them)
    assert all(r["resolved"] in REGISTRY[name] for r in rows if r["algorithm"] == "auto"), rows
    world.Barrier()
    if rank == 0:
        assert json.loads(Path(path).read_text()) == rows
        assert f"MPI.Comm.{COLLECTIVES[operation].raw_call} straight from mpi4py" in text, text
        assert "wrong elements in total: 0" in text, text
        (dtype_line,) = [line for line in text.splitlines() if line.startswith("# dtype ")]
        assert dtype_line.endswith(f"   root {p - 1}") == (operation != "alltoall"), dtype_line


@pytest.mark.mpi
@pytest.mark.parametrize("operation", sorted(NCCL_TESTS))
@pytest.mark.parametrize("size", ["8", "4K"])
def test_auto_row_names_what_auto_ran(operation, size):
    """The auto row's "resolved" is the algorithm the Communicator really ran for auto at that size (its stats),
    so the row's size is the byte count the Communicator asks auto about."""
    name = NCCL_TESTS[operation][0]
    comm = Communicator(MPI.COMM_WORLD)
    try:
        rows, _ = bench("--op", operation, "--algorithms", "auto", "-b", size, "-e", size, "-w", "0", "-n", "1",
                        "--rounds", "1", comm=comm)
        ran = set(comm.stats()[name])
    finally:
        comm.free()
    (auto,) = [r for r in rows if r["algorithm"] == "auto"]
    assert ran == {"native", auto["resolved"]}, (ran, auto)  # native: the vs_native baseline, always timed


@pytest.mark.mpi
@pytest.mark.parametrize("operation", sorted(NCCL_TESTS))
def test_check_catches_a_broken_rooted_or_alltoall_algorithm(operation, monkeypatch):
    """An algorithm that is native plus one wrong element on the last rank (the root) is counted: exactly one
    wrong element in its row, none in native's."""
    name = NCCL_TESTS[operation][0]
    comm = Communicator(MPI.COMM_WORLD)  # built before "broken" exists, so its selector never picks it
    native = REGISTRY[name]["native"]

    def broken(t, *args):
        native(t, *args)
        out = args[_OUTPUT_ARG[name]]
        if t.rank == t.size - 1:
            out[-1] += 1

    monkeypatch.setitem(REGISTRY[name], "broken", broken)
    p = comm.size
    try:
        rows, text = bench("--op", operation, "--algorithms", "broken", "--root", str(p - 1), "-b", "64", "-e", "64",
                           "-w", "0", "-n", "1", "--check", comm=comm)
    finally:
        comm.free()
    by_algorithm = {r["algorithm"]: r for r in rows}
    assert set(by_algorithm) == {RAW, "native", "broken"}
    assert by_algorithm["native"]["wrong"] == 0 and by_algorithm[RAW]["wrong"] == 0
    assert by_algorithm["broken"]["wrong"] == 1
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "FAILED" in text


# ---------------------------------------------------------------- pure parts (no communication)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 64])
def test_busbw_factors(p):
    assert busbw_factor("allreduce", p) == pytest.approx(2 * (p - 1) / p)
    assert busbw_factor("reduce_scatter", p) == pytest.approx((p - 1) / p)
    assert busbw_factor("all_gather", p) == pytest.approx((p - 1) / p)
    assert busbw_factor("broadcast", p) == 1.0
    assert busbw_factor("sendrecv", p) == 1.0
    for operation, (_, factor, _) in NCCL_TESTS.items():
        assert busbw_factor(operation, p) == pytest.approx(float(factor(p))), operation


def test_layout_follows_nccl_tests():
    # allreduce: count = bytes / itemsize; reduce_scatter / all_gather: count per rank, size = full buffer
    assert COLLECTIVES["allreduce"].layout(1000, 4, 3) == (250, 1000)
    assert COLLECTIVES["reduce_scatter"].layout(1000, 4, 3) == (83, 996)
    assert COLLECTIVES["all_gather"].layout(8, 8, 4) == (1, 32)  # at least one element per rank
    # reduce: the whole vector; gather / scatter: count per rank; alltoall: count per peer block, size the send buffer
    assert COLLECTIVES["reduce"].layout(1000, 4, 3) == (250, 1000)
    assert COLLECTIVES["gather"].layout(1000, 4, 3) == (83, 996)
    assert COLLECTIVES["scatter"].layout(1000, 4, 3) == (83, 996)
    assert COLLECTIVES["alltoall"].layout(1000, 4, 3) == (83, 996)
    assert COLLECTIVES["alltoall"].layout(8, 4, 4) == (1, 16)


def test_sizes_and_suffixes():
    assert sizes(8, 128, 4) == [8, 32, 128]
    assert sizes(8, 100, 4) == [8, 32, 100]
    assert sizes(64, 64, 4) == [64]
    assert parse_size("64M") == 64 * 2**20 and parse_size("8") == 8 and parse_size("2k") == 2048
    assert parse_size("1G") == 2**30 and parse_size("16KB") == 16384


def test_block_lasts_the_block_time_or_the_call_cap_within_the_budget():
    calls_for_block_time = math.ceil(BLOCK_SECONDS / 60e-6)
    assert block_calls(5e-6, 1000, 0.33) == 1000                  # 1000 calls come first (5 ms)
    assert block_calls(60e-6, 1000, 0.33) == calls_for_block_time  # 10 ms comes first
    assert block_calls(60e-6, 20, 0.33) == 20                     # an explicit -n caps it
    assert block_calls(1e-4, 1000, 0.005) == 50                   # the budget caps it
    assert block_calls(0.03, 1000, 0.33) == 1 and block_calls(5.0, 1000, 0.33) == 1  # never below one call
    assert block_calls(0.0, 7, 1.0) == 7


def _exact(column: list, redop: str):
    """One element's reduction over the ranks in Python's exact arithmetic: integers, Gaussian integers as
    (re, im) pairs for complex, a Fraction for a real avg (the inputs are integer-valued)."""
    if isinstance(column[0], tuple):
        if redop == "prod":
            def times(a, b):
                return a[0] * b[0] - a[1] * b[1], a[0] * b[1] + a[1] * b[0]
            value = column[0]
            for z in column[1:]:
                value = times(value, z)
            return value
        return sum(z[0] for z in column), sum(z[1] for z in column)  # avg: the sum (see the test)
    reduce = {"sum": sum, "prod": math.prod, "min": min, "max": max}
    return Fraction(sum(column), len(column)) if redop == "avg" else reduce[redop](column)


def _as_python(value, complex_: bool):
    if complex_:
        assert value.real == int(value.real) and value.imag == int(value.imag)
        return int(value.real), int(value.imag)
    assert float(value) == int(value)
    return int(value)


SUPPORTED = [(str(d), op) for d, op in dtype_op_pairs()]  # the contract's dtype/op table, stated by conftest


@pytest.mark.parametrize("p", [3, 4])
@pytest.mark.parametrize("dtype, redop", SUPPORTED)
def test_reference_is_exact_arithmetic_and_exact_in_any_order(dtype, redop, p):
    """The reference equals Python's exact arithmetic element by element (no numpy reduction involved), and
    the inputs reduce to that same value in the dtype itself in every rank order: so any correct algorithm,
    whatever its order, matches the reference bitwise."""
    dt = np.dtype(DTYPES[dtype])
    complex_ = dt.kind == "c"
    inputs = [rank_input(r, 100, dt, redop, p) for r in range(p)]
    as_python = [[_as_python(v, complex_) for v in x.astype(np.complex128 if complex_ else np.float64)]
                 for x in inputs]
    exact = [_exact(list(column), redop) for column in zip(*as_python)]
    if complex_:
        expected = np.array([complex(re, im) for re, im in exact]).astype(dt)
        if redop == "avg":  # the contract divides the exact sum in the dtype; numpy's complex division by p+0j
            expected = expected / np.array(p, dtype=dt)  # multiplies by 1/p: not the correctly rounded quotient
    else:
        expected = np.array([float(v) for v in exact]).astype(dt)  # float() of a Fraction is correctly rounded
    assert count_wrong(reference_reduce(inputs, dt, redop), expected) == 0
    ufunc = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[redop]
    for order in itertools.permutations(range(p)):
        acc = inputs[order[0]].copy()
        for r in order[1:]:
            acc = ufunc(acc, inputs[r]).astype(dt)  # accumulated in the dtype itself
        if redop == "avg":
            acc = (acc / np.array(p, dtype=dt)).astype(dt)
        assert count_wrong(acc, expected) == 0, order
    assert count_wrong(sentinel_like(expected), expected) == expected.size


@pytest.mark.parametrize("dtype, redop", SUPPORTED)
def test_timing_data_is_a_fixed_point_of_the_reduction(dtype, redop):
    """An in-place all-reduce feeds each timed call its previous result: the timing data must reduce to itself
    (for min/max after the first call), or thousands of calls overflow."""
    dt = np.dtype(DTYPES[dtype])
    for p in (2, 3, 4):
        data = [steady_input(rank_input(r, 100, dt, redop, p), redop) for r in range(p)]
        settled = reference_reduce(data, dt, redop)
        assert count_wrong(reference_reduce([settled] * p, dt, redop), settled) == 0, p
        if redop in ("sum", "avg", "prod"):
            assert count_wrong(settled, data[0]) == 0, p


def test_count_wrong_values():
    a = np.array([0.0, 1.0, np.nan], np.float32)
    assert count_wrong(a, np.array([-0.0, 1.0, np.nan], np.float32)) == 0
    assert count_wrong(a, np.array([0.0, 2.0, 1.0], np.float32)) == 2


@pytest.mark.parametrize("argv, message", [
    (["--op", "alltoallv"], "invalid choice"),
    (["--op", "alltoall", "--algorithms", "ring"], "'ring' is not registered for alltoall"),
    (["--op", "gather", "--algorithms", "rhd"], "'rhd' is not registered for gather"),
    (["--op", "scatter", "--root", "99"], "out of range"),
    (["--algorithms", "bogus"], "'bogus' is not registered for allreduce"),
    (["--op", "broadcast", "--algorithms", "ring"], "'ring' is not registered for broadcast"),
    (["--op", "sendrecv", "--algorithms", "auto"], "'auto' is not registered for sendrecv"),
    (["-b", "12X"], "invalid size"),
    (["-b", "1M", "-e", "1K"], "larger than"),
    (["-f", "1"], "must be >= 2"),
    (["-n", "0"], "must be >= 1"),
    (["--dtype", "float8"], "unknown dtype"),
    (["--redop", "xor"], "unknown op"),
    (["--dtype", "bool", "--redop", "sum"], "no supported dtype/redop"),
    (["--root", "99"], "out of range"),
    (["--budget", "0"], "must be > 0"),
    (["--rounds", "0"], "must be >= 1"),
    (["--wire", "fp8"], "unknown wire(s) ['fp8']"),
    (["--op", "reduce", "--wire", "bf16"], "--wire applies to --op allreduce, not reduce"),
    (["--wire", "int8", "--dtype", "float64"], "compresses float32 sum/avg only"),
    (["--wire", "int8", "--redop", "max"], "compresses float32 sum/avg only"),
])
def test_bad_flags_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        run(argv)
    assert info.value.code == 2
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the command lines (subprocesses)
@serial_only
def test_cli_runs_with_one_process_without_mpiexec(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "mpcomm.bench", "--op", "reduce_scatter", "-e", "1K", "-n", "2",
                           "--check", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrong elements in total: 0" in proc.stdout
    assert all(r["wrong"] == 0 for r in json.loads(out.read_text()))


@serial_only
def test_bench_trust_script_runs():
    """bench/bench_trust.py (default timing vs a long loop, measured by hand) runs and reports its ratio."""
    script = Path(__file__).resolve().parent.parent / "bench" / "bench_trust.py"
    proc = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script), "--repeat", "1", "--calls", "50"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "driver native / 50-call loop: median" in proc.stdout, proc.stdout


@serial_only
def test_run_main_aborts_the_job_when_one_rank_raises(tmp_path):
    mpiexec = mpiexec_path()
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        from mpi4py import MPI
        from mpcomm.launch import run_main

        def main():
            if MPI.COMM_WORLD.Get_rank() == 1:
                raise RuntimeError("boom on rank one")
            MPI.COMM_WORLD.recv(source=1)  # would wait forever without the abort

        run_main(main)
    """))
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "boom on rank one" in proc.stderr and "rank 1 of 2" in proc.stderr


@serial_only
def test_alltoall_sweep_script_at_toy_sizes(tmp_path):
    """bench/alltoall_sweep.sh (the timed sweep behind the all-to-all figures) runs end to end at toy sizes and
    writes per size every algorithm's time, auto's choice and its ratio to the best (auto_vs_best.py --times)."""
    script = Path(__file__).resolve().parent.parent / "bench" / "alltoall_sweep.sh"
    env = dict(os.environ, OUT=str(tmp_path), MAXBYTES="64", RANKS="2", PYTHON=sys.executable, MPIEXEC=mpiexec_path())
    proc = subprocess.run([str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "alltoall_p2.json").read_text())
    assert {r["size"] for r in rows} == {8, 32, 64} and all(r["wrong"] == 0 for r in rows), rows
    report = (tmp_path / "alltoall.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| size (B) |"))
    for column in (f"{RAW} us", "native us", "pairwise us", "bruck us", "auto chose", "auto / best"):
        assert column in header, header
    table = [line for line in report.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(line.split("|")[1]) for line in table] == [8, 32, 64], report
    assert "--op alltoall -b 8 -e 64 -f 4" in report and "worst auto / best" in report, report
