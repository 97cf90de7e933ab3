"""GPU buffers: CUDA-awareness detection, the host-staging pipeline, DLPack inputs, and CuPy collectives.

* The detection decision is a pure function, tested on the values libraries report.
* The staging pipeline (chunking, message matching, byte-count checks, time-outs, the whole-buffer route of
  ``native``) is exercised on real MPI with a host-memory copier (``HostStagedTransport`` below): the same
  ``StagedTransport`` code, with numpy arrays standing in for device memory, so it runs on any machine.
  The CUDA half (streams, events, pinned memory) runs only in the CuPy tests.
* The CuPy tests run wherever CuPy and a CUDA GPU exist (``ci/gpu.sh``) and skip cleanly elsewhere: every
  registered algorithm, float16/bfloat16/float32, compared bit for bit with the numpy path.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_cuda.py`` (any N >= 1);
the unit tests also run without mpiexec.
"""
from __future__ import annotations

from contextlib import nullcontext

import ml_dtypes
import numpy as np
import pytest
from conftest import WORLD, assert_bitwise_equal, gather, in_step, make_input, run_gathered
from mpi4py import MPI

import mpcomm
from mpcomm import cuda, p2p, staging
from mpcomm.algorithms import REGISTRY
from mpcomm.buffers import as_array, as_output, reduce_op
from mpcomm.errors import CommTimeoutError, MpcommError
from mpcomm.transport import Transport

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
GPU_DTYPES = [np.dtype(np.float16), BFLOAT16, np.dtype(np.float32)]

try:  # CuPy with a usable GPU, or skip the CuPy tests
    import cupy

    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # noqa: BLE001 - ImportError, or CuPy without a driver/GPU
    cupy, HAVE_GPU = None, False

needs_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
if HAVE_GPU:
    cupy.cuda.Device(WORLD.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()

OPENMPI_4 = "Open MPI v4.1.5, package: Open MPI Distribution, ident: 4.1.5, repo rev: v4.1.5"
MPICH_5 = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\nMPICH Device:       ch4:ucx ofi"
INTEL = "Intel(R) MPI Library 2021.11 for Linux* OS"
OTHER = "Some Vendor MPI 1.0"


# ================================================================================== detection (pure)
@pytest.mark.parametrize(
    "env, mpix, library, ompi, mpich, aware, phrase",
    [
        # the environment overrides everything, both ways
        ("1", 0, OPENMPI_4, 0, None, True, "MPCOMM_CUDA_AWARE=1"),
        ("0", 1, OPENMPI_4, 1, None, False, "MPCOMM_CUDA_AWARE=0"),
        ("true", None, OTHER, None, None, True, "overrides"),
        ("off", 1, MPICH_5, None, 1, False, "overrides"),
        (" ", 1, MPICH_5, None, None, True, "MPIX_Query_cuda_support() returned 1"),  # blank = unset
        # the library's run-time query decides next, over the build-time variables
        (None, 1, OPENMPI_4, 0, None, True, "MPIX_Query_cuda_support() returned 1"),
        (None, 0, OPENMPI_4, 1, None, False, "MPIX_Query_cuda_support() returned 0"),
        (None, 0, MPICH_5, None, 1, False, "returned 0"),
        (None, 1, MPICH_5, None, 0, True, "returned 1"),
        # Open MPI without the query: its build-time control variable
        (None, None, OPENMPI_4, 1, None, True, "mpi_built_with_cuda_support=1"),
        (None, None, OPENMPI_4, 0, None, False, "mpi_built_with_cuda_support=0"),
        (None, None, OPENMPI_4, None, None, False, "assuming not CUDA-aware"),
        # MPICH without the query: the cvar can only say no
        (None, None, MPICH_5, None, 0, False, "MPIR_CVAR_ENABLE_GPU=0"),
        (None, None, INTEL, None, "0", False, "MPIR_CVAR_ENABLE_GPU=0"),
        (None, None, MPICH_5, None, 1, False, "not assumed"),
        (None, None, MPICH_5, None, None, False, "assuming not CUDA-aware"),
        # variables of another vendor are not read as this one's
        (None, None, MPICH_5, 1, None, False, "assuming not CUDA-aware"),
        (None, None, OTHER, 1, 1, False, "assuming not CUDA-aware"),
        (None, None, "", None, None, False, "unknown MPI"),
    ],
)
def test_decision_table(env, mpix, library, ompi, mpich, aware, phrase):
    got, reason = cuda.decide_cuda_aware(env, mpix, library, ompi, mpich)
    assert got is aware
    assert phrase in reason


def test_bad_override_is_loud():
    with pytest.raises(ValueError, match="MPCOMM_CUDA_AWARE='maybe'"):
        cuda.decide_cuda_aware("maybe", 1, OPENMPI_4, None, None)


@pytest.mark.parametrize("text, expected", [
    (OPENMPI_4, "openmpi"), (MPICH_5, "mpich"), (INTEL, "mpich"), ("MVAPICH2 Version 2.3", "mpich"),
    (OTHER, "unknown"), (None, "unknown"),
])
def test_vendor(text, expected):
    assert cuda.vendor(text) == expected


def test_detection_of_this_process_is_consistent():
    """What was read from the loaded library, fed to the pure function, gives the cached answer."""
    found = cuda.detection()
    assert found.library_version == MPI.Get_library_version()
    assert found.libraries, "the MPI library mpi4py loaded was not found"
    again = cuda.decide_cuda_aware(found.env_value, found.mpix_query, found.library_version,
                                   found.ompi_info_value, found.mpich_cvar)
    assert again == (found.aware, found.reason)
    assert mpcomm.cuda_aware() is found.aware
    assert mpcomm.cuda_aware(explain=True) == (found.aware, found.reason)
    if cuda.vendor(found.library_version) == "mpich" and "5.0" in found.library_version:
        assert found.mpix_query is not None, "MPICH >= 4 exports MPIX_Query_cuda_support"


def test_detection_leaves_the_thread_level_alone():
    """Reading MPI_T control variables must not change the thread level MPI reports (Open MPI's
    MPI_T_init_thread overwrites it with the level asked for; asking for SINGLE turned off the progress thread)."""
    before = MPI.Query_thread()
    cuda.detection(refresh=True)
    assert MPI.Query_thread() == before


def test_environment_override_and_refresh(monkeypatch):
    try:
        monkeypatch.setenv("MPCOMM_CUDA_AWARE", "1")
        assert mpcomm.cuda_aware(refresh=True) is True
        monkeypatch.setenv("MPCOMM_CUDA_AWARE", "0")
        assert mpcomm.cuda_aware() is True, "the answer is cached until refresh"
        assert mpcomm.cuda_aware(explain=True, refresh=True) == (False, "MPCOMM_CUDA_AWARE=0 overrides detection")
    finally:
        monkeypatch.delenv("MPCOMM_CUDA_AWARE", raising=False)
        cuda.detection(refresh=True)


# ================================================================================== staging helpers (pure)
def test_chunk_ranges():
    assert staging.chunk_ranges(0, 8) == [(0, 0)]
    assert staging.chunk_ranges(8, 8) == [(0, 8)]
    assert staging.chunk_ranges(20, 8) == [(0, 8), (8, 16), (16, 20)]


@pytest.mark.parametrize("value, expected", [("", staging.DEFAULT_CHUNK), ("65536", 65536), ("512k", 512 << 10),
                                             ("4M", 4 << 20), ("1", 4096)])
def test_chunk_bytes(monkeypatch, value, expected):
    monkeypatch.setenv(staging.CHUNK_ENV, value)
    assert staging.chunk_bytes() == expected


def test_chunk_bytes_rejects_garbage(monkeypatch):
    monkeypatch.setenv(staging.CHUNK_ENV, "lots")
    with pytest.raises(ValueError, match="MPCOMM_STAGING_CHUNK"):
        staging.chunk_bytes()


def test_host_arrays_never_wrapped():
    t = object()
    a, b = np.zeros(3), np.zeros(4)
    assert staging.for_arrays(t, "allreduce", a, b) is t
    assert staging.for_buffers(t, "send", bytearray(4)) is t


# ================================================================================== DLPack inputs
class DLPackOnly:
    """Exposes only ``__dlpack__``/``__dlpack_device__`` (numpy's own), not the buffer protocol."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


# numpy before 2.2.5 imports every DLPack array read-only (numpy/numpy#28599)
DLPACK_WRITABLE = np.from_dlpack(np.zeros(1)).flags.writeable


def test_dlpack_object_is_zero_copy():
    base = np.arange(6, dtype=np.float32)
    obj = DLPackOnly(base)
    with pytest.raises(TypeError):
        memoryview(obj)
    view = as_array(obj)
    assert isinstance(view, np.ndarray) and np.shares_memory(view, base)
    if DLPACK_WRITABLE:
        view[0] = 42
        assert base[0] == 42
    else:
        with pytest.raises(ValueError, match="allreduce: output buffer is read-only .*numpy before 2.2.5"):
            as_output(obj, "allreduce")


class UnversionedDLPack(DLPackOnly):
    """Exports the unversioned (pre-1.0) DLPack capsule, which numpy imports read-only on every release."""

    def __dlpack__(self, **kwargs):
        try:
            return self._array.__dlpack__(max_version=None)
        except TypeError:  # (numpy before 2.1 exports only that one)
            return self._array.__dlpack__()


def test_a_read_only_dlpack_output_says_why():
    data = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"allreduce: output buffer is read-only .*numpy before 2\.2\.5 imports every "
                       r"DLPack array read-only, later releases those of exporters of the unversioned protocol"):
        as_output(UnversionedDLPack(data), "allreduce")
    data.flags.writeable = False  # a read-only numpy array: no word of DLPack
    with pytest.raises(ValueError, match=r"allreduce: output buffer is read-only \(shape \(6,\), dtype float32\)$"):
        as_output(data, "allreduce")


@pytest.mark.torch
def test_torch_cpu_tensor_is_zero_copy():
    torch = pytest.importorskip("torch")
    tensor = torch.arange(5, dtype=torch.float32)
    view = as_array(tensor)
    view[1] = -7
    assert tensor[1].item() == -7


@pytest.mark.mpi
def test_allreduce_on_dlpack_object(comm):
    data = make_input(np.float32, "sum", (33,), comm.rank)
    original = data.copy()
    if not DLPACK_WRITABLE:  # refused on every rank, saying why, with nothing sent
        with pytest.raises(ValueError, match="allreduce: output buffer is read-only .*numpy before 2.2.5"):
            comm.allreduce(DLPackOnly(data), op="sum", algorithm="ring")
        np.testing.assert_array_equal(data, original)
        comm.allreduce(data, op="sum", algorithm="ring")  # (still usable: the same sum by the buffer protocol)
    else:
        comm.allreduce(DLPackOnly(data), op="sum", algorithm="ring")  # in place through DLPack
    expected = sum(gather(original)[1:], gather(original)[0].astype(np.float64)).astype(np.float32)
    results = gather(data)
    assert_bitwise_equal(results, "allreduce through __dlpack__")
    np.testing.assert_allclose(results[0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.torch
@pytest.mark.mpi
def test_allreduce_on_torch_tensor(comm):
    torch = pytest.importorskip("torch")
    tensor = torch.full((17,), float(comm.rank + 1))
    returned = comm.allreduce(tensor, op="sum")
    assert returned is tensor and bool((tensor == comm.size * (comm.size + 1) / 2).all()), tensor


# ================================================================================== staging pipeline on host memory
class _HostEvent:
    """Reports done only after ``polls`` queries, so the pipeline's wait-for-copy path is taken."""

    def __init__(self, polls: int):
        self._polls = polls

    @property
    def done(self) -> bool:
        self._polls -= 1
        return self._polls < 0

    def synchronize(self) -> None:
        self._polls = -1


class HostCopier:
    """The copier interface of ``staging.CudaCopier`` over host memory: the "device" is a numpy array."""

    def __init__(self):
        self._slots: dict[str, np.ndarray] = {}
        self.copies = {"to_host": 0, "to_device": 0}

    def scope(self):
        return nullcontext()

    def pinned(self, nbytes):
        return np.empty(nbytes, np.uint8)

    def slot(self, name, nbytes):
        if name not in self._slots or self._slots[name].nbytes < nbytes:
            self._slots[name] = np.empty(max(nbytes, 1), np.uint8)
        return self._slots[name][:nbytes]

    def after_caller(self):
        pass

    @staticmethod
    def _bytes(array):
        return array.reshape(-1).view(np.uint8)

    def to_host(self, host, device, lo=0, hi=None):
        hi = device.nbytes if hi is None else hi
        host[lo:hi] = self._bytes(device)[lo:hi]
        self.copies["to_host"] += 1
        return _HostEvent(polls=2)

    def to_device(self, device, host, lo=0, hi=None):
        hi = device.nbytes if hi is None else hi
        self._bytes(device)[lo:hi] = host[lo:hi]
        self.copies["to_device"] += 1

    def sync_d2h(self):
        pass

    def sync_h2d(self):
        pass

    contiguous = staticmethod(np.ascontiguousarray)
    empty = staticmethod(np.empty)


class HostStagedTransport(staging.StagedTransport):
    """``StagedTransport`` treating numpy arrays as the staged ones, copied by ``HostCopier``."""

    staged = staticmethod(lambda array: isinstance(array, np.ndarray))

    def __init__(self, inner, chunk=None):
        super().__init__(inner, chunk)
        self.copier = HostCopier()

    def copier_for(self, array):
        return self.copier


def _copies(t, kind):
    """Copies made by ``t`` and the node/cross transports it made (hierarchical) together."""
    return t.copier.copies[kind] + sum(_copies(sub, kind) for sub in t._subs.values())


@pytest.fixture
def staged():
    """A fresh staged transport over its own duplicate of COMM_WORLD, in 64-byte chunks."""
    inner = Transport(WORLD.Dup(), timeout=30.0)
    yield HostStagedTransport(inner, chunk=64)
    inner.free()


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(REGISTRY["allreduce"]))
@pytest.mark.parametrize("count", [0, 1, 7, 100, 1000])
def test_staged_allreduce_matches_plain(comm, staged, name, count):
    data = make_input(np.float32, "sum", (count,), comm.rank)
    plain = data.copy()
    comm.allreduce(plain, op="sum", algorithm=name)
    work = data.copy()

    def body():
        with staged.running(f"staged allreduce[{name}]"):
            if count:
                staging.algorithm(staged, "allreduce", name, REGISTRY["allreduce"][name])(staged, work, reduce_op("sum"))

    in_step(body)
    results = gather(work)
    assert_bitwise_equal(results, "staged allreduce")
    assert_bitwise_equal([results[0], gather(plain)[0]], f"staged {name} vs plain {name}")
    if comm.size > 1 and count >= 100 and name not in staging.HOST_COLLECTIVES:
        assert _copies(staged, "to_host") > 1, "the transfer was not cut into chunks"


@pytest.mark.mpi
@pytest.mark.parametrize("operation", ["reduce_scatter", "all_gather"])
def test_staged_scatter_gather_match_plain(comm, staged, operation):
    p = comm.size
    for name in sorted(REGISTRY[operation]):
        if operation == "reduce_scatter":
            send = make_input(np.float32, "sum", (p * 37,), comm.rank)
            plain, work = np.empty(37, np.float32), np.empty(37, np.float32)
            comm.reduce_scatter(send, plain, op="sum", algorithm=name)
            args = (send, work, reduce_op("sum"))
        else:
            send = make_input(np.float32, "sum", (37,), comm.rank)
            plain, work = np.empty(p * 37, np.float32), np.empty(p * 37, np.float32)
            comm.all_gather(send, plain, algorithm=name)
            args = (send, work)
        in_step(lambda: staging.algorithm(staged, operation, name, REGISTRY[operation][name])(staged, *args))
        assert_bitwise_equal([work, plain], f"staged {operation}[{name}] vs plain")
        if operation == "all_gather":
            assert_bitwise_equal(gather(work), f"staged {operation}[{name}] across ranks")


@pytest.mark.mpi
def test_staged_broadcast_and_native_route(comm, staged):
    for name in sorted(REGISTRY["broadcast"]):
        buf = np.full(50, comm.rank, dtype=np.int64)
        in_step(lambda: staging.algorithm(staged, "broadcast", name, REGISTRY["broadcast"][name])(staged, buf, comm.size - 1))
        assert (buf == comm.size - 1).all(), f"broadcast[{name}]"
    # native is routed through whole-buffer host copies: one copy out per argument, one back per output
    before = dict(staged.copier.copies)
    buf = np.full(10, comm.rank + 1.0)
    in_step(lambda: staging.algorithm(staged, "allreduce", "native", REGISTRY["allreduce"]["native"])(staged, buf, reduce_op("sum")))
    assert (buf == comm.size * (comm.size + 1) / 2).all()
    assert staged.copier.copies["to_host"] - before["to_host"] == 1
    assert staged.copier.copies["to_device"] - before["to_device"] == 1


def test_staged_wire_refuses_staged_arrays():
    inner = Transport(MPI.COMM_SELF.Dup(), timeout=5.0)
    try:
        t = HostStagedTransport(inner)
        with pytest.raises(TypeError, match="not CUDA-aware"):
            t._wire(np.zeros(4))
    finally:
        inner.free()


@pytest.mark.mpi
def test_staged_p2p_ring(comm, staged):
    """p2p's envelope + payload with the payload through the non-blocking staged path (whole-message copies in
    wait): a message above p2p.INLINE_BYTES, so the payload is not carried in the envelope."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    count = p2p.INLINE_BYTES // 8 + 300
    out = np.arange(count, dtype=np.float64) + comm.rank
    got = np.empty(count, np.float64)
    envelopes = Transport(WORLD.Dup(), timeout=30.0)
    channels = p2p.Channels(envelopes, staged)
    copies_before = staged.copier.copies["to_host"]

    def body():
        receiving = p2p.irecv(channels, staged, got, left, tag=3)
        sending = p2p.isend(channels, staged, out, right, tag=3)
        sending.wait()
        receiving.wait()

    in_step(body)
    envelopes.free()
    np.testing.assert_array_equal(got, np.arange(count, dtype=np.float64) + left)
    assert staged.copier.copies["to_host"] > copies_before  # the payload really went through staging


@pytest.mark.mpi
def test_staged_size_mismatch_raises(staged):
    if WORLD.Get_size() < 2:
        pytest.skip("needs 2 ranks")
    rank = WORLD.Get_rank()

    def body():
        if rank == 0:
            staged.send(np.zeros(100, np.uint8), 1)
        elif rank == 1:
            staged.recv(np.zeros(200, np.uint8), 0)

    outcomes = run_gathered(lambda: _outcome(body))
    assert outcomes[0] is None
    assert outcomes[1] is not None and "expected 64" in outcomes[1]


def _outcome(body):
    try:
        body()
    except MpcommError as exc:
        return str(exc)
    return None


def test_staged_recv_times_out():
    inner = Transport(MPI.COMM_SELF.Dup(), timeout=0.3)
    try:
        t = HostStagedTransport(inner, chunk=64)
        with pytest.raises(CommTimeoutError, match="timed out"):
            t.recv(np.zeros(10, np.uint8), 0)
    finally:
        inner.free()


# ================================================================================== CuPy (needs a GPU)
def _cupy_lacks_bfloat16() -> str | None:
    """Why this CuPy cannot hold bfloat16 arrays (older CuPy has none; cupy/cupy#9494 added ``ml_dtypes.bfloat16``).
    The only reason a CuPy test may skip for its dtype: anything else that goes wrong on the GPU must fail."""
    try:
        cupy.empty(1, dtype=BFLOAT16)
    except (TypeError, ValueError, NotImplementedError) as exc:  # CuPy's refusals of a dtype it does not know
        return f"CuPy {cupy.__version__} has no bfloat16 arrays ({type(exc).__name__}: {exc})"
    return None


def _device_input(dtype, op, count, rank, seed=0):
    host = make_input(dtype, op, (count,), rank, seed)
    if np.dtype(dtype) == BFLOAT16 and (reason := _cupy_lacks_bfloat16()):
        pytest.skip(reason)
    return host, cupy.asarray(host)


def _bits(array):
    array = cupy.asnumpy(array) if HAVE_GPU and isinstance(array, cupy.ndarray) else np.asarray(array)
    return array.reshape(-1).view(np.uint8)


@needs_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(REGISTRY["allreduce"]) + ["auto"])
@pytest.mark.parametrize("count", [0, 1, 7, 1000, (3 << 20) // 4 + 5])
def test_cupy_allreduce_equals_numpy(comm, name, dtype, count):
    host, device = _device_input(dtype, "sum", count, comm.rank)
    in_step(lambda: comm.allreduce(host, op="sum", algorithm=name))
    in_step(lambda: comm.allreduce(device, op="sum", algorithm=name))
    assert isinstance(device, cupy.ndarray)
    assert (_bits(device) == _bits(host)).all(), f"CuPy allreduce[{name}] differs from the numpy path"
    assert_bitwise_equal(gather(cupy.asnumpy(device)), "CuPy allreduce across ranks")


@needs_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("op", ["max", "avg"])
def test_cupy_allreduce_ops(comm, op):
    host, device = _device_input(np.float32, op, 4099, comm.rank)
    in_step(lambda: comm.allreduce(host, op=op))
    in_step(lambda: comm.allreduce(device, op=op))
    assert (_bits(device) == _bits(host)).all()


@needs_gpu
@pytest.mark.mpi
@pytest.mark.parametrize("operation", ["reduce_scatter", "all_gather", "broadcast"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_cupy_other_collectives_equal_numpy(comm, operation, dtype):
    p = comm.size
    for name in sorted(REGISTRY[operation]):
        if operation == "reduce_scatter":
            send, dsend = _device_input(dtype, "sum", p * 1001, comm.rank)
            host, device = np.empty(1001, dtype), cupy.empty(1001, dtype)
            in_step(lambda: comm.reduce_scatter(send, host, algorithm=name))
            in_step(lambda: comm.reduce_scatter(dsend, device, algorithm=name))
        elif operation == "all_gather":
            send, dsend = _device_input(dtype, "sum", 1001, comm.rank)
            host, device = np.empty(p * 1001, dtype), cupy.empty(p * 1001, dtype)
            in_step(lambda: comm.all_gather(send, host, algorithm=name))
            in_step(lambda: comm.all_gather(dsend, device, algorithm=name))
        else:
            host, device = _device_input(dtype, "sum", 1001, comm.rank)
            in_step(lambda: comm.broadcast(host, root=p - 1, algorithm=name))
            in_step(lambda: comm.broadcast(device, root=p - 1, algorithm=name))
        assert (_bits(device) == _bits(host)).all(), f"CuPy {operation}[{name}] differs from the numpy path"


@needs_gpu
@pytest.mark.mpi
def test_cupy_nonblocking_and_p2p(comm):
    host, device = _device_input(np.float32, "sum", 5000, comm.rank)
    in_step(lambda: comm.allreduce(host))
    in_step(lambda: comm.iallreduce(device).wait())
    assert (_bits(device) == _bits(host)).all()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = cupy.arange(3000, dtype=cupy.float32) + comm.rank
    got = cupy.empty(3000, cupy.float32)
    in_step(lambda: comm.sendrecv(out, right, got, left, tag=5))
    assert (cupy.asnumpy(got) == np.arange(3000, dtype=np.float32) + left).all()
    if comm.size > 1:
        in_step(lambda: comm.send(out, right, tag=6) if comm.rank % 2 == 0 else comm.recv(got, left, tag=6))
        in_step(lambda: comm.send(out, right, tag=6) if comm.rank % 2 == 1 else comm.recv(got, left, tag=6))
        assert (cupy.asnumpy(got) == np.arange(3000, dtype=np.float32) + left).all()


@needs_gpu
@pytest.mark.mpi
def test_cupy_mixed_devices_rejected():
    comm = mpcomm.Communicator(MPI.COMM_SELF)
    try:
        with pytest.raises(ValueError, match="different devices"):
            comm.reduce_scatter(cupy.zeros(4, cupy.float32), np.zeros(4, np.float32))
        with pytest.raises(ValueError, match="different devices"):
            comm.sendrecv(cupy.zeros(4, cupy.float32), 0, np.zeros(4, np.float32), 0)
    finally:
        comm.free()


@needs_gpu
@pytest.mark.mpi
def test_cupy_transport_choice():
    inner = Transport(MPI.COMM_SELF.Dup(), timeout=5.0)
    try:
        chosen = staging.for_arrays(inner, "allreduce", cupy.zeros(3))
        expected = staging.DirectTransport if mpcomm.cuda_aware() else staging.StagedTransport
        assert type(chosen) is expected
        if not mpcomm.cuda_aware():
            with pytest.raises(TypeError, match="not CUDA-aware"):
                chosen._wire(cupy.zeros(3))
    finally:
        inner.free()
