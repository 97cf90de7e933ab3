"""The backend's C++ all-reduce (``mpcomm/integrations/torch/native_allreduce.cpp``): which calls take it, that they
give numpy's reduction of every rank's input bit for bit on every rank, and that the Communicator's guarantees
(the deadline, the unusable communicator, the records, auto's choice after a tuning table) hold on it.

Inputs are made on every rank for every rank (``inputs``), so the reference is numpy's reduction of the gathered
inputs, not another all-reduce. ``make test-torch`` builds the extension first; with ``MPCOMM_TORCH_NATIVE=0`` (no
extension) these tests skip, everything else runs through Python.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_native_allreduce.py``.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from datetime import timedelta

import numpy as np
import pytest
from conftest import WORLD, assert_bitwise_equal, gather, in_step

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from mpcomm import CommTimeoutError  # noqa: E402
from mpcomm.algorithms import native  # noqa: E402
from mpcomm.integrations.torch import allreduce, extension  # noqa: E402
from mpcomm.mpi_library import forced, library, loaded_path  # noqa: E402
from torch_backend.groups import backend_of, fail_on_rank0_then_destroy  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
R = dist.ReduceOp
pytestmark = [pytest.mark.torch,
              pytest.mark.skipif(os.environ.get(extension.SWITCH, "1") == "0",
                                 reason=f"{extension.SWITCH}=0: the backend runs without its C++ extension")]
several = pytest.mark.skipif(SIZE < 2, reason="on one rank auto plans no MPI all-reduce (nothing to combine)")
INTEGERS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
FLOATS = [torch.float32, torch.float64]
NUMPY = {"SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum}
NAMES = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}  # mpcomm's


def inputs(n: int, dtype, salt: int = 0) -> list[torch.Tensor]:
    """Every rank's input, made alike on every rank: small values, so sums and products stay exact and in range
    for every dtype (products of up to 4 values in -2..2; uint8 in 0..3)."""
    low = 0 if dtype is torch.uint8 else -2
    return [((torch.arange(n) * (salt + 3) + 7 * r + salt) % 4 + low).to(dtype) for r in range(SIZE)]


def takes_cpp_path(group, tensor: torch.Tensor, op: str = "sum") -> bool:
    """Whether the C++ path takes an all-reduce of ``tensor`` by ``op`` (mpcomm's name): where auto plans native
    with MPI's own op, not where native reduces with mpcomm's (float sums on Open MPI at every size), nor where
    native meets and then blocks (Open MPI from 4 KiB: the C++ call only polls)."""
    comm = backend_of(group).comm
    array = tensor.numpy()
    planned = comm.plan("allreduce", array, op, "auto")
    return (planned.algorithm == "native" and native.own_op(comm.transport, array, planned.rop) is None
            and not native.meets_then_blocks(comm.transport, library(), array.nbytes))


def sync_opts() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # what dist.all_reduce(t) passes
    return opts


def calls(group, algorithm: str) -> int:
    return backend_of(group).comm.stats().get("allreduce", {}).get(algorithm, {}).get("calls", 0)


def test_the_extension_builds_against_the_mpi_library_mpi4py_runs():
    """make test-torch builds it first: here it must load (a failure to build would only warn in the backend)."""
    assert os.path.basename(loaded_path()).startswith(("libmpi.so", "libmpich.so"))
    module = extension.build()
    from mpi4py import MPI

    assert module.library_version().splitlines()[0] == MPI.Get_library_version().splitlines()[0]


@pytest.mark.skipif(SIZE > 1, reason="one process: the other ranks would build beside it, on the same lock")
def test_a_lock_left_by_a_build_that_died_is_cleared():
    """torch 2.13 waits forever on the lock file of a build that was killed; a lock older than any build is
    removed. torch 2.14 locks the file through the kernel and builds past an old one."""
    directory = extension.build_directory(extension.NAME)
    if directory is None:
        pytest.skip("the environment's directory is not writable: torch's default place is used")
    lock = os.path.join(directory, "lock")
    open(lock, "w").close()
    then = time.time() - 2 * extension.STALE_LOCK_SECONDS
    os.utime(lock, (then, then))
    build = "from mpi4py import MPI; from mpcomm.integrations.torch import extension; extension.build()"
    alone = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDI_", "MPI_LOCAL"))}  # (no mpiexec)
    done = subprocess.run([sys.executable, "-W", "always", "-c", build], capture_output=True, text=True, env=alone,
                          timeout=120)  # (in a child, so that a regression fails here instead of hanging the suite)
    assert done.returncode == 0, done.stderr
    if extension.lock_file_blocks():  # torch 2.13: the file is the lock, so it had to go
        assert "did not finish" in done.stderr
        assert not os.path.exists(lock)
    else:  # torch 2.14 on: an OS lock on the file; an old file neither blocks nor is removed
        assert "did not finish" not in done.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", FLOATS + INTEGERS, ids=str)
def test_taken_where_auto_plans_native_and_equal_to_numpy(pg, dtype):
    """For every op the C++ path runs (SUM, PRODUCT; MIN and MAX on integers) and sizes 1, 7, 1000: it is taken
    exactly where the Communicator plans its native all-reduce with MPI's own op (where native would reduce with
    mpcomm's, the C++ path steps aside: every rank must reduce with the same op), the result is numpy's reduction
    of every rank's input bit for bit on every rank, and the Communicator records the call."""
    ops = ["SUM", "PRODUCT"] + ([] if dtype.is_floating_point else ["MIN", "MAX"])
    for op in ops:
        for n in (1, 7, 1000):
            everyone = inputs(n, dtype, salt=len(op))
            tensor = everyone[RANK].clone()
            opts = sync_opts()
            opts.reduceOp = getattr(R, op)
            plan = backend_of(pg)._native_plan(tensor, opts)
            array = tensor.numpy()
            assert (plan is not None) == takes_cpp_path(pg, tensor, NAMES[op]), (op, n)
            before = calls(pg, "native")
            dist.all_reduce(tensor, op=getattr(R, op))
            expected = NUMPY[op].reduce(np.stack([t.numpy() for t in everyone]), axis=0)
            assert tensor.numpy().tobytes() == expected.astype(array.dtype).tobytes(), (op, n)
            assert_bitwise_equal(gather(tensor.numpy()), f"{op} n={n}")
            if plan is not None:
                assert plan.fn is backend_of(pg)._native_run
                assert calls(pg, "native") == before + 1


@pytest.mark.mpi
@pytest.mark.skipif(SIZE < 2, reason="NaNs are made canonical when ranks combine them")
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_nans_come_out_as_numpys_on_every_rank(pg, dtype):
    """NaNs of different signs and payloads on different ranks: numpy's nan, the same bits everywhere (through the
    C++ path where it takes float sums, else through native's own op)."""
    np_dtype, bits = (np.float32, np.uint32) if dtype is torch.float32 else (np.float64, np.uint64)
    other_nan = (np.array([np.nan], dtype=np_dtype).view(bits) | (RANK + 1)).view(np_dtype)[0]  # a payload
    raw = np.array([np.nan, -np.nan, other_nan, 1.0] if RANK % 2 == 0 else [1.0, 2.0, other_nan, 1.0], np_dtype)
    tensor = torch.from_numpy(raw.copy())
    assert (backend_of(pg)._native_plan(tensor, sync_opts()) is not None) == takes_cpp_path(pg, tensor)
    dist.all_reduce(tensor)
    result = tensor.numpy()
    assert_bitwise_equal(gather(result), "sum with NaNs")
    nan_bits = int(np.array([np.nan], dtype=np_dtype).view(bits)[0])
    assert [int(b) for b in result[:3].view(bits)] == [nan_bits] * 3
    assert result[3] == SIZE


@pytest.mark.mpi
def test_other_calls_take_the_general_path_and_agree(pg):
    """Asynchronous calls, strided tensors, floating MIN/MAX, AVG, bfloat16 and empty tensors are not the C++
    path's; each still equals numpy's reduction of the gathered inputs."""
    cases = {"async": (lambda t: dist.all_reduce(t, async_op=True).wait(), "SUM", torch.float32, False),
             "strided": (lambda t: dist.all_reduce(t), "SUM", torch.float32, True),
             "float MIN": (lambda t: dist.all_reduce(t, op=R.MIN), "MIN", torch.float64, False),
             "float MAX": (lambda t: dist.all_reduce(t, op=R.MAX), "MAX", torch.float32, False),
             "bfloat16": (lambda t: dist.all_reduce(t), "SUM", torch.bfloat16, False)}
    for name, (call, op, dtype, strided) in cases.items():
        everyone = inputs(12, dtype, salt=len(name))
        tensor = everyone[RANK].clone()
        if strided:
            tensor = torch.stack([tensor, tensor], dim=1)[:, 0]  # every other element of a (12, 2) tensor
            assert not tensor.is_contiguous()
        opts = sync_opts()
        opts.reduceOp = getattr(R, op)
        opts.asyncOp = name == "async"
        assert backend_of(pg)._native_plan(tensor, opts) is None, name
        call(tensor)
        expected = NUMPY[op].reduce(np.stack([t.float().numpy() for t in everyone]), axis=0)
        assert np.array_equal(tensor.float().numpy(), expected), name
    empty = torch.zeros(0)
    assert backend_of(pg)._native_plan(empty, sync_opts()) is None
    dist.all_reduce(empty)


@pytest.mark.mpi
@several
def test_a_tensor_that_requires_grad_is_reduced_in_place(pg):
    weight = torch.nn.Parameter(inputs(5, torch.float32)[RANK].clone())
    assert (backend_of(pg)._native_plan(weight, sync_opts()) is not None) == takes_cpp_path(pg, weight.detach())
    with torch.no_grad():
        dist.all_reduce(weight)
    expected = np.sum([t.numpy() for t in inputs(5, torch.float32)], axis=0)
    assert np.array_equal(weight.detach().numpy(), expected)


@pytest.mark.mpi
@several
def test_where_native_meets_then_blocks_the_cpp_path_steps_aside(pg, monkeypatch):
    """The C++ all-reduce only polls a non-blocking call: where the library's profile has native meet the other
    ranks and block (Open MPI from 4 KiB), the call runs through Python's native instead, and is right. Across
    hosts native never blocks (mpcomm.mpi_library), so there the C++ path keeps the call."""
    monkeypatch.setattr(allreduce, "library", lambda: forced("meet+blocking"))
    everyone = inputs(37, torch.float32, salt=7)
    tensor = everyone[RANK].clone()
    one_host = backend_of(pg).comm.num_nodes == 1
    assert (backend_of(pg)._native_plan(tensor, sync_opts()) is None) == one_host
    dist.all_reduce(tensor)
    assert np.array_equal(tensor.numpy(), np.sum([t.numpy() for t in everyone], axis=0))


@pytest.mark.mpi
@several
def test_a_tuning_table_that_prefers_another_algorithm_is_followed(pg):
    """auto's choice changes with a table (here: tree measured alone at 8 bytes): the C++ path steps aside and
    the call runs tree; the Communicator's plans and the extension's agree again afterwards."""
    tensor = torch.ones(2, dtype=torch.int32)  # (the C++ path's on every library: no mpcomm op for integers)
    assert backend_of(pg)._native_plan(tensor, sync_opts()) is not None
    in_step(lambda: backend_of(pg).comm.tune(sizes=[8], repeats=1, algorithms=["tree"], verbose=False))
    assert backend_of(pg)._native_plan(tensor, sync_opts()) is None
    before = calls(pg, "tree")
    dist.all_reduce(tensor)
    assert calls(pg, "tree") == before + 1
    assert tensor.tolist() == [SIZE] * 2


@pytest.mark.mpi
@pytest.mark.skipif(SIZE < 2, reason="needs a rank that does not come")
def test_a_rank_that_never_comes_is_a_timeout_and_the_group_is_unusable(pg):
    """Rank 0 alone all-reduces on a group with a 1 s timeout: DistBackendError naming the timeout, raised by the
    transport's 1 s deadline (not a hang), later calls refuse (the all-reduce may still be in flight), destroying
    the group warns. (The deadline's own clock is judged: a VM stall outside the wait once took the call 36 s.)"""
    dist.barrier()  # (making the group is collective under its 1 s too: the ranks come to it together)
    group = dist.new_group(timeout=timedelta(seconds=1))

    def rank0():
        tensor = torch.ones(2, dtype=torch.int32)
        assert backend_of(group)._native_plan(tensor, sync_opts()) is not None
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError, match=" timeout ") as raised:
            dist.all_reduce(tensor, group=group)
        assert time.monotonic() - start > 0.9
        deadline = raised.value.__cause__
        assert isinstance(deadline, CommTimeoutError) and deadline.timeout == 1, repr(deadline)
        assert 0.9 < deadline.elapsed < 20
        with pytest.raises(dist.DistBackendError, match="unusable"):
            dist.all_reduce(torch.ones(2), group=group)

    fail_on_rank0_then_destroy(group, rank0)


@pytest.mark.mpi
@several
def test_sub_groups_run_on_their_own_communicators(pg):
    """Two sub-groups (every rank, and the ranks in reverse): each all-reduce in C++ on its own communicator."""
    forward, backward = dist.new_group(list(range(SIZE))), dist.new_group(list(reversed(range(SIZE))))
    results = {}
    for name, group in (("forward", forward), ("backward", backward)):
        tensor = torch.full((3,), RANK + 1, dtype=torch.int32)
        assert backend_of(group)._native_plan(tensor, sync_opts()) is not None
        dist.all_reduce(tensor, group=group)
        results[name] = tensor.tolist()
    assert results == {name: [SIZE * (SIZE + 1) // 2] * 3 for name in results}


@pytest.mark.mpi
@several
def test_validate_compares_the_calls_on_the_cpp_path_too(pg, monkeypatch):
    """MPCOMM_VALIDATE=1: a group's matching calls run in C++; sizes that differ between ranks raise
    CollectiveMismatchError (as DistBackendError) on every rank instead of reducing garbage."""
    monkeypatch.setenv("MPCOMM_VALIDATE", "1")
    group = dist.new_group()
    assert backend_of(group).comm.validate
    tensor = torch.full((4,), RANK, dtype=torch.int32)
    assert backend_of(group)._native_plan(tensor, sync_opts()) is not None
    dist.all_reduce(tensor, group=group)
    assert tensor.tolist() == [SIZE * (SIZE - 1) // 2] * 4
    mismatched = torch.ones(3 if RANK == 0 else 4, dtype=torch.int32)
    assert backend_of(group)._native_plan(mismatched, sync_opts()) is not None
    with pytest.raises(dist.DistBackendError, match="CollectiveMismatchError"):
        dist.all_reduce(mismatched, group=group)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a group whose call failed is left allocated (test_backend_semantics)
        in_step(lambda: dist.destroy_process_group(group))
