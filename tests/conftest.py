"""Shared test machinery: the run header (which MPI, mpi4py, numpy, world size), the session Communicator,
and independent references built from every rank's inputs with ``MPI.COMM_WORLD.allgather`` + numpy.

Multi-rank tests run with pytest-mpi, e.g. ``timeout 600 mpiexec -n 4 python -m pytest -q --with-mpi -m mpi tests/``.
Every helper here that talks to other ranks is collective: all ranks must call it in the same order.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import mpcomm.info
from mpcomm import Communicator
from mpcomm.cuda import vendor

WORLD = MPI.COMM_WORLD
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
LOW_PRECISION = (np.dtype(np.float16), BFLOAT16)
FLOATS = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
INTS = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
COMPLEX = (np.dtype(np.complex64), np.dtype(np.complex128))
BOOL = np.dtype(np.bool_)
ALL_DTYPES = FLOATS + INTS + COMPLEX + (BOOL,)
OPS = ("sum", "prod", "min", "max", "avg")


def pytest_configure(config: pytest.Config) -> None:
    """Under mpiexec every rank gets its own pytest temp root: ranks sharing one race to clean it up.
    Marker ``torch``: the test needs PyTorch; ``make test-torch`` installs it and runs every test so marked."""
    config.addinivalue_line("markers", "torch: needs PyTorch (CPU build); run by `make test-torch`")
    if WORLD.Get_size() > 1 and config.option.basetemp is None:
        name = f"pytest-mpcomm-{os.getppid()}-rank{WORLD.Get_rank()}"  # parent: this job's launcher proxy
        config.option.basetemp = os.path.join(tempfile.gettempdir(), name)


def ops_for(dtype) -> tuple[str, ...]:
    """The ops the contract supports for ``dtype`` (the independent statement of the dtype/op table)."""
    dtype = np.dtype(dtype)
    if dtype == BOOL:
        return ("min", "max")
    if dtype in COMPLEX:
        return ("sum", "prod", "avg")
    if dtype in INTS:
        return ("sum", "prod", "min", "max")
    return OPS


def dtype_op_pairs() -> list[tuple[np.dtype, str]]:
    return [(d, op) for d in ALL_DTYPES for op in ops_for(d)]


def dtype_id(value) -> str:
    return str(np.dtype(value)) if isinstance(value, (np.dtype, type)) else str(value)


# ------------------------------------------------------------------------------------------ header
def _header_line() -> str:
    return f"{mpcomm.info.describe()} | world size {WORLD.Get_size()}"


def pytest_report_header(config) -> list[str]:
    return [_header_line()]


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session) -> None:
    """With -q pytest hides report headers; say which MPI this log comes from anyway (rank 0 only)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and session.config.option.verbose < 0 and WORLD.Get_rank() == 0:
        reporter.write_line(_header_line())


# ------------------------------------------------------------------------------------------ tests that launch mpiexec
# Started by an mpiexec (Open MPI's sets OMPI_COMM_WORLD_*; other OMPI_ variables, e.g. OMPI_ALLOW_RUN_AS_ROOT, are
# settings of a shell made for Open MPI's mpiexec, and say nothing of which MPI this process runs)
LAUNCHED = WORLD.Get_size() > 1 or any(k.startswith(("PMI_", "OMPI_COMM_WORLD_", "HYDRA_")) for k in os.environ)
# The tests marked serial_only launch the venv's mpiexec as MPICH's is launched (hydra, as Intel MPI's too): on Open
# MPI (PRRTE) they are skipped; tests that do run there check LAUNCHED (tests/test_trace_hangs.py)
serial_only = pytest.mark.skipif(LAUNCHED or vendor(MPI.Get_library_version()) == "openmpi",
                                 reason="launches mpiexec itself, as MPICH's: run it in the serial pytest pass, on "
                                        "MPICH or Intel MPI")


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the venv's MPI) or on PATH; skips the calling test when there is none."""
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec")
    return found


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def comm(request: pytest.FixtureRequest) -> Iterator[Communicator]:
    """The Communicator over MPI.COMM_WORLD shared by one test module's tests, freed after the module (a module
    sets ``COMM_TIMEOUT`` for another timeout than the default)."""
    c = Communicator(WORLD, timeout=getattr(request.module, "COMM_TIMEOUT", None))
    yield c
    c.free()


@pytest.fixture
def world_comm() -> Iterator[Communicator]:
    """A Communicator over MPI.COMM_WORLD for one test alone (it may split it, build engines on it, or leave it
    unusable), freed after the test."""
    c = Communicator(WORLD)
    yield c
    c.free()


@pytest.fixture
def pg():
    """The default torch process group on the mpcomm backend (rank and size from MPI, no MASTER_ADDR), destroyed
    after the test; torch is imported only by the tests that ask for it."""
    from torch_backend.groups import default_group_on_mpcomm

    yield from default_group_on_mpcomm()


# ------------------------------------------------------------------------------------------ keeping ranks in step
def run_gathered(fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` on every rank and return every rank's result (rank order) with ONE allgather.
    If ``fn`` raised anywhere, raise on every rank (so no rank is left waiting in a later collective)
    with what each rank saw."""
    try:
        result, error = fn(), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        result, error = None, exc
    everyone = WORLD.allgather((None if error is None else f"{type(error).__name__}: {error}", result))
    failures = [(r, e) for r, (e, _) in enumerate(everyone) if e]
    if failures:
        described = "; ".join(f"rank {r}: {e}" for r, e in failures)
        raise AssertionError(f"failed on some ranks — {described}") from error
    return [r for _, r in everyone]


def in_step(fn: Callable[[], Any]) -> Any:
    """``fn()`` on this rank (not gathered), raising on every rank if it raised on any (see run_gathered)."""
    box = []
    run_gathered(lambda: box.append(fn()))
    return box[0]


def without_rank(silent: int, call: Callable[[], Any]) -> list[Any]:
    """Collective: every rank but ``silent`` runs ``call``, which must give up waiting for the silent rank with a
    CommTimeoutError. Per rank, in rank order: None for the silent rank; (the error's message, seconds it took); or
    the string "completed without rank {silent}" where the call returned."""
    from mpcomm import CommTimeoutError

    def run():
        if WORLD.Get_rank() == silent:
            return None
        start = time.monotonic()
        try:
            call()
        except CommTimeoutError as exc:
            return str(exc), time.monotonic() - start
        return f"completed without rank {silent}"

    return run_gathered(run)


def gather(array) -> list[np.ndarray]:
    """Every rank's ``array`` (a copy), in rank order."""
    return WORLD.allgather(np.array(array, copy=True))


def assert_bitwise_equal(arrays: list[np.ndarray], what: str = "result") -> None:
    """The arrays (one per rank, already gathered) have identical bytes."""
    first = np.ascontiguousarray(arrays[0]).tobytes()
    differing = [r for r, a in enumerate(arrays) if np.ascontiguousarray(a).tobytes() != first]
    assert not differing, f"{what} differs bitwise between rank 0 and rank(s) {differing}"


def assert_identical_across_ranks(array, what: str = "result") -> None:
    """Collective: the bytes of ``array`` are the same on every rank (results must be bitwise identical)."""
    assert_bitwise_equal(WORLD.allgather(np.ascontiguousarray(array)), what)


# ------------------------------------------------------------------------------------------ inputs
def make_input(dtype, op: str, shape, rank: int, seed: int = 0) -> np.ndarray:
    """Rank-specific inputs whose exact reduction over up to 4 ranks is representable:
    integers never overflow, and float16/bfloat16 values have few significant bits so that their sum or
    product is exact in float32 — the reference is then the exact value rounded once."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([seed, rank, zlib.crc32(f"{dtype}/{op}".encode())])
    n = int(np.prod(shape))
    if dtype == BOOL:
        values = rng.random(n) < 0.5
    elif dtype in INTS:
        info = np.iinfo(dtype)
        if op in ("min", "max"):
            values = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)
        elif op == "prod":
            values = rng.choice([-1, 1, 2] if info.min < 0 else [1, 2, 3], size=n)  # |prod| <= 81 over 4 ranks
        else:
            values = rng.integers(-25 if info.min < 0 else 0, 26, size=n)  # |sum| <= 100 over 4 ranks
    elif dtype in LOW_PRECISION:
        if op == "prod":
            values = rng.choice([-2.0, -1.5, -1.0, -0.75, 0.5, 1.0, 1.25, 2.0], size=n)
        else:  # k * 2^e with 6-bit k: sums over 4 ranks are exact in float32, not in float16/bfloat16
            values = rng.integers(-63, 64, size=n) * np.exp2(rng.integers(-4, 5, size=n))
    elif dtype in COMPLEX:
        if op == "prod":
            values = np.exp(1j * rng.uniform(-np.pi, np.pi, n)) * rng.uniform(0.5, 1.5, n)
        else:
            values = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    else:
        values = rng.uniform(0.5, 1.5, n) * rng.choice([-1, 1], n) if op == "prod" else rng.standard_normal(n)
    return np.asarray(values).astype(dtype).reshape(shape)


# ------------------------------------------------------------------------------------------ references
_UFUNC = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add}


def reference_reduce(inputs: list[np.ndarray], op: str) -> np.ndarray:
    """The reduction of ``inputs`` (one per rank) computed by numpy, independently of mpcomm:
    integers and bool in their own dtype, float16/bfloat16 accumulated in float32 and rounded once,
    float32/float64/complex in float64/complex128 (the result keeps that precision)."""
    dtype = inputs[0].dtype
    if op in ("min", "max") or dtype in INTS or dtype == BOOL:
        acc_dtype = dtype
    elif dtype in LOW_PRECISION:
        acc_dtype = np.dtype(np.float32)
    else:
        acc_dtype = np.dtype(np.complex128 if dtype in COMPLEX else np.float64)
    acc = inputs[0].astype(acc_dtype, copy=True)
    for other in inputs[1:]:
        _UFUNC[op](acc, other.astype(acc_dtype), out=acc)
    if op == "avg":
        acc = acc / acc_dtype.type(len(inputs))
    return acc.astype(dtype) if dtype in LOW_PRECISION else acc


def assert_reduced(result: np.ndarray, inputs: list[np.ndarray], op: str, expected=None, what: str = "") -> None:
    """``result`` equals the reduction of ``inputs``: exactly for integers, bool, min/max and the
    (exact-input) float16/bfloat16 cases; within accumulation-order tolerance for other floats."""
    expected = reference_reduce(inputs, op) if expected is None else expected
    dtype = result.dtype
    label = f"{what} {op} {dtype} shape {result.shape}"
    assert result.shape == expected.shape, label
    if op in ("min", "max") or dtype in INTS or dtype == BOOL or dtype in LOW_PRECISION:
        bad = np.flatnonzero(result.reshape(-1).view(np.uint8 if dtype == BOOL else dtype) != expected.reshape(-1))
        assert bad.size == 0, (
            f"{label}: {bad.size} wrong elements, first at {bad[0]}: got {result.reshape(-1)[bad[0]]!r}, "
            f"expected {expected.reshape(-1)[bad[0]]!r}"
        )
        return
    eps = np.finfo(np.float32 if dtype in (np.float32, np.complex64) else np.float64).eps
    if op in ("sum", "avg"):  # rounding error of a sum scales with the sum of magnitudes, not the result
        magnitude = sum(np.abs(x).astype(np.float64) for x in inputs) / (len(inputs) if op == "avg" else 1)
    else:
        magnitude = np.abs(expected).astype(np.float64)
    tolerance = 4 * len(inputs) * eps * (magnitude + np.finfo(np.float64).tiny)
    error = np.abs(result.astype(expected.dtype) - expected)
    bad = np.flatnonzero(error > tolerance)
    assert bad.size == 0, (
        f"{label}: {bad.size} elements beyond tolerance, first at {bad[0]}: got {result.reshape(-1)[bad[0]]!r}, "
        f"expected {expected.reshape(-1)[bad[0]]!r}"
    )


def assert_matches_single_process(engine, losses, workload, optimizer="sgd", lr=0.1, rtol=1e-10) -> None:
    """``losses`` and ``engine.full_state_dict()`` equal one process training ``workload`` on the whole batch."""
    from mpcomm.parallel.threed import reference_train
    from mpcomm.workload import param_checksum

    ref_losses, ref = reference_train(workload, len(losses), optimizer, lr)
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    full = engine.full_state_dict()
    ref_state = dict(ref.named_parameters())
    assert sorted(full) == sorted(ref_state)
    for name, a in full.items():
        np.testing.assert_allclose(a, ref_state[name].data, rtol=rtol, atol=1e-14, err_msg=name)
    np.testing.assert_allclose(param_checksum(full.items()), param_checksum(ref.state_dict().items()), rtol=rtol)
