"""mpcomm-bench: the driver in-process at any world size, its arithmetic, its flags and its launcher.

    timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_bench.py   (N = 1..4)
    python -m pytest -q tests/test_bench.py                                                (serial parts)
"""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms import REGISTRY
from mpcomm.bench import COLLECTIVES, busbw_factor, run
from mpcomm.bench.base import count_wrong, rank_input, reference_reduce, sentinel_like
from mpcomm.bench.cli import parse_size
from mpcomm.bench.driver import sizes

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
    assert {r["algorithm"] for r in rows} == set(COLLECTIVES[operation].algorithms())
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "wrong elements in total: 0" in text and "OK" in text


@pytest.mark.mpi
@pytest.mark.parametrize("rounds, iters", [(1, 4), (3, 4), (3, 2), (5, 1)])
def test_rounds_interleave_algorithms_within_the_iteration_cap(rounds, iters):
    """Round-robin rounds never time more than -n calls per point, and every row still has a positive time."""
    rows, text = bench("-b", "64", "-e", "4K", "-f", "64", "-w", "1", "-n", str(iters), "--rounds", str(rounds),
                       "--algorithms", "ring,rhd,native,auto")
    assert rows and all(1 <= r["iters"] <= iters and r["time_us"] > 0 for r in rows), rows
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert f"{min(rounds, iters)} round-robin rounds" in text


@pytest.mark.mpi
@pytest.mark.parametrize("operation", ["allreduce", "reduce_scatter"])
def test_check_every_dtype_and_redop(operation):
    rows, _ = bench("--op", operation, "--dtype", "all", "--redop", "all", "-b", "24", "-e", "24", "-w", "0", "-n", "1",
                    "--check", "--algorithms", "ring,rhd,native")
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
    world = MPI.COMM_WORLD
    folder = world.bcast(str(tmp_path_factory.mktemp("bench")) if world.Get_rank() == 0 else None)
    path_json, path_png = os.path.join(folder, "rows.json"), os.path.join(folder, "bw.png")
    rows, text = bench("--op", "all_gather", "--json", path_json, "--plot", path_png, *QUICK)
    world.Barrier()
    if world.Get_rank() == 0:
        written = json.loads(Path(path_json).read_text())
        assert isinstance(written, list) and len(written) == len(rows)
        for row in written:
            assert CONTRACT_KEYS <= set(row)
            assert row["busbw"] == pytest.approx(row["algbw"] * (world.Get_size() - 1) / world.Get_size())
            assert row["algbw"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9)
            assert row["size"] == row["count"] * world.Get_size() * 4  # float32, count per rank (nccl-tests)
        assert Path(path_png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "memcpy" in text and "MPI library" in text and "vs_native" in text


@pytest.mark.mpi
def test_vs_native_and_auto_rows():
    rows, _ = bench("-b", "1K", "-e", "1K", "-w", "1", "-n", "2")
    native = next(r for r in rows if r["algorithm"] == "native")
    assert native["vs_native"] == pytest.approx(1.0)
    for row in rows:
        assert row["vs_native"] == pytest.approx(native["time_us"] / row["time_us"])
        assert row["wrong"] is None  # not checked without --check
    auto = next(r for r in rows if r["algorithm"] == "auto")
    assert auto["resolved"] is None or auto["resolved"] in REGISTRY["allreduce"]


# ---------------------------------------------------------------- pure parts (no communication)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8, 64])
def test_busbw_factors(p):
    assert busbw_factor("allreduce", p) == pytest.approx(2 * (p - 1) / p)
    assert busbw_factor("reduce_scatter", p) == pytest.approx((p - 1) / p)
    assert busbw_factor("all_gather", p) == pytest.approx((p - 1) / p)
    assert busbw_factor("broadcast", p) == 1.0
    assert busbw_factor("sendrecv", p) == 1.0


def test_layout_follows_nccl_tests():
    # allreduce: count = bytes / itemsize; reduce_scatter / all_gather: count per rank, size = full buffer
    assert COLLECTIVES["allreduce"].layout(1000, 4, 3) == (250, 1000)
    assert COLLECTIVES["reduce_scatter"].layout(1000, 4, 3) == (83, 996)
    assert COLLECTIVES["all_gather"].layout(8, 8, 4) == (1, 32)  # at least one element per rank


def test_sizes_and_suffixes():
    assert sizes(8, 128, 4) == [8, 32, 128]
    assert sizes(8, 100, 4) == [8, 32, 100]
    assert sizes(64, 64, 4) == [64]
    assert parse_size("64M") == 64 * 2**20 and parse_size("8") == 8 and parse_size("2k") == 2048
    assert parse_size("1G") == 2**30 and parse_size("16KB") == 16384


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "int8", "uint8", "complex64", "int64"])
@pytest.mark.parametrize("redop", ["sum", "prod", "min", "max", "avg"])
def test_reference_is_exact_in_any_order(dtype, redop):
    from mpcomm.bench.base import BFLOAT16

    dt = BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    if redop == "avg" and dt.kind in "iu" or redop in ("min", "max") and dt.kind == "c":
        pytest.skip("unsupported by the contract")
    p = 4
    inputs = [rank_input(r, 500, dt, redop, p) for r in range(p)]
    forward = reference_reduce(inputs, dt, redop)
    backward = reference_reduce(inputs[::-1], dt, redop)
    assert count_wrong(forward, backward) == 0
    if redop == "sum":  # the same sum accumulated naively in the dtype itself is exact too
        acc = inputs[0].copy()
        for x in inputs[1:]:
            acc = (acc + x).astype(dt)
        assert count_wrong(acc, forward) == 0
    assert count_wrong(sentinel_like(forward), forward) == forward.size


def test_count_wrong_values():
    a = np.array([0.0, 1.0, np.nan], np.float32)
    assert count_wrong(a, np.array([-0.0, 1.0, np.nan], np.float32)) == 0
    assert count_wrong(a, np.array([0.0, 2.0, 1.0], np.float32)) == 2


@pytest.mark.parametrize("argv, message", [
    (["--op", "alltoall"], "invalid choice"),
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
])
def test_bad_flags_give_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        run(argv)
    assert info.value.code == 2
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the command lines (subprocesses)
def _under_mpiexec() -> bool:
    return MPI.COMM_WORLD.Get_size() > 1 or any(k.startswith(("PMI_", "OMPI_", "HYDRA_")) for k in os.environ)


@pytest.mark.skipif(_under_mpiexec(), reason="launches its own processes; run it in the serial pytest pass")
def test_cli_runs_with_one_process_without_mpiexec(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-m", "mpcomm.bench", "--op", "reduce_scatter", "-e", "1K", "-n", "2",
                           "--check", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "wrong elements in total: 0" in proc.stdout
    assert all(r["wrong"] == 0 for r in json.loads(out.read_text()))


@pytest.mark.skipif(_under_mpiexec(), reason="launches mpiexec itself; run it in the serial pytest pass")
def test_run_main_aborts_the_job_when_one_rank_raises(tmp_path):
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec")
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
