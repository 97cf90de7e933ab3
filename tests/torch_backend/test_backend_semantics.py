"""How the mpcomm backend runs calls: failures raise (from the call, from ``wait()``, through the future), every
group's collectives pair up in issue order whatever ``async_op`` each rank passed, queued collectives progress
without being waited on, synchronous ones start no thread; and what it does beyond gloo (uneven all-gather,
float8 data movement, sparse all-reduce, monitored barrier), each against an independent reference.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_backend_semantics.py``.
The single-process tests (the lane, the op table) run without ``-m mpi``.
"""
from __future__ import annotations

import threading
import time
import warnings
from datetime import timedelta

import numpy as np
import pytest
from conftest import WORLD, in_step, run_gathered

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import mpcomm.integrations.torch as mpt  # noqa: E402
from mpcomm.algorithms import native  # noqa: E402
from mpcomm.errors import MpcommError  # noqa: E402
from mpcomm.integrations.torch.lane import Job, Lane, queued_work  # noqa: E402
from mpcomm.integrations.torch.tensors import as_numpy, reduction  # noqa: E402
from mpcomm.mpi_library import forced  # noqa: E402
from torch_backend.groups import backend_of, fail_on_rank0_then_destroy  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = pytest.mark.torch
R = dist.ReduceOp
multi = pytest.mark.skipif(SIZE < 2, reason="needs several ranks")


# ================================================================================== single process
def test_reduction_table_follows_gloo():
    assert (reduction(R.SUM, torch.bool, "x").name, reduction(R.PRODUCT, torch.bool, "x").name) == ("max", "min")
    assert reduction(R.BXOR, torch.bool, "x").local is np.bitwise_xor
    assert reduction(R.BAND, torch.int32, "x").local is np.bitwise_and
    assert reduction(R.AVG, torch.bfloat16, "x").name == "avg"
    with pytest.raises(TypeError, match="BAND needs an integral or bool tensor"):
        reduction(R.BAND, torch.float32, "allreduce")
    with pytest.raises(TypeError, match="AVG needs a floating tensor"):
        reduction(R.AVG, torch.bool, "allreduce")
    with pytest.raises(NotImplementedError, match="PREMUL_SUM"):
        reduction(dist._make_nccl_premul_sum(2.0), torch.float32, "allreduce")
    with pytest.raises(TypeError, match="cannot be reduced"):
        reduction(R.SUM, torch.float8_e4m3fn, "allreduce")


def test_tensors_that_are_not_dense_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="torch.sparse_csr tensor; only dense"):
        as_numpy(torch.eye(3).to_sparse_csr(), "allreduce tensor")


def _lane_with_log():
    log = []

    def job(name, fail=False):
        def body():
            log.append((name, threading.current_thread().name))
            if fail:
                raise MpcommError(f"{name} failed")
        return Job(body, [name], name)

    return Lane("unit"), log, job


def test_lane_runs_queued_jobs_in_order_and_refuses_to_jump_them():
    lane, log, job = _lane_with_log()
    gate = threading.Event()
    lane.submit(Job(gate.wait, [], "blocker"))  # keeps the worker busy
    jobs = [job(f"j{i}") for i in range(3)]
    for j in jobs:
        lane.submit(j)
    assert not lane.enter(), "a synchronous call must not run before the queued ones"
    gate.set()
    queued_work(lane, jobs[-1]).wait()
    assert [name for name, _ in log] == ["j0", "j1", "j2"]
    # Nothing pending: the caller may run inline once the worker has let go of the lane (it marks the last job
    # done, which wakes wait(), a moment before it releases the lane).
    deadline = time.monotonic() + 5.0
    while not lane.enter():
        assert time.monotonic() < deadline, "the lane stayed taken after its queue had run"
        time.sleep(0.001)
    lane.leave()
    lane.close()


def test_lane_failure_reaches_wait_and_future():
    lane, log, job = _lane_with_log()
    failing = job("bad", fail=True)
    lane.submit(failing)
    work = queued_work(lane, failing)
    with pytest.raises(dist.DistBackendError, match="bad failed"):
        work.wait()
    assert work.is_completed() and not work.is_success()
    with pytest.raises(Exception, match="bad failed"):
        work.get_future().wait()
    lane.close()


def test_lane_future_callback_may_wait_on_a_job_it_issues():
    """torch's powerSGD_hook issues a collective inside a future's callback and blocks on that one's future: the
    lane must run it meanwhile (the callback ran on the worker, holding the lane, and waited forever before)."""
    lane, log, job = _lane_with_log()
    first, second = job("first"), job("second")
    reached = threading.Event()

    def issue_and_wait(_):
        lane.submit(second)
        lane.future_of(second).wait()
        reached.set()

    lane.future_of(first).then(issue_and_wait)
    lane.submit(first)
    assert reached.wait(20), "the callback's collective never ran"
    assert [name for name, _ in log] == ["first", "second"]
    lane.close()


def _compute(seconds: float) -> None:
    """A callback's own work: the thread stays busy (on the CPU) for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_lane_runs_a_future_callbacks_collectives_before_other_threads_ones():
    """PowerSGD's pattern with several DDP buckets: a bucket's callbacks compute, then issue collectives and wait
    on them, while the main thread issues the next buckets'. The callbacks' go first whatever the timing, so every
    rank pairs them alike (before, the worker's successor ran the main thread's at once)."""
    lane, log, job = _lane_with_log()
    gate, computing = threading.Event(), threading.Event()
    first = Job(lambda: (gate.wait(), log.append(("a", ""))), [], "a")
    issued = [job("b"), job("c")]
    later = [job("d1"), job("d2")]

    def callback(_):
        computing.set()
        for j in issued:
            _compute(0.1)
            lane.submit(j)
            lane.future_of(j).wait()

    lane.future_of(first).then(callback)
    lane.submit(first)
    lane.submit(later[0])  # queued before the callbacks run
    gate.set()
    assert computing.wait(20)
    assert not lane.enter(), "a synchronous call ran while another thread's callbacks may still issue"
    lane.submit(later[1])  # queued while they run
    queued_work(lane, later[1]).wait()
    assert [name for name, _ in log] == ["a", "b", "c", "d1", "d2"]
    lane.close()


def test_lane_goes_on_when_a_callback_blocks_on_a_later_collective(monkeypatch):
    """A callback that waits (through its future, invisibly to the lane) on a collective queued after it by another
    thread would hold the lane forever: once its thread has been idle for CALLBACK_IDLE_S the lane goes on, and
    says so."""
    import mpcomm.integrations.torch.lane as lane_module

    monkeypatch.setattr(lane_module, "CALLBACK_IDLE_S", 0.3)
    lane, log, job = _lane_with_log()
    gate, reached = threading.Event(), threading.Event()
    first = Job(lambda: (gate.wait(), log.append(("a", ""))), [], "a")
    later = job("later")
    lane.submit(first)
    lane.submit(later)
    lane.future_of(first).then(lambda _: (lane.future_of(later).wait(), reached.set()))
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="blocked for 0.3 s on something other than a collective it issued"):
        gate.set()
        assert reached.wait(20), "the lane waited forever for a blocked callback"
    assert time.monotonic() - start >= 0.3
    assert [name for name, _ in log] == ["a", "later"]
    lane.close()


def test_lane_wait_with_timeout_leaves_the_job_running():
    lane, log, job = _lane_with_log()
    gate = threading.Event()
    slow = Job(gate.wait, [], "slow")
    lane.submit(slow)
    work = queued_work(lane, slow)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match="Timed out waiting 200ms"):
        work.wait(timedelta(milliseconds=200))
    assert 0.15 < time.monotonic() - start < 5
    gate.set()
    assert work.wait() is True
    lane.close()


# ================================================================================== multi-rank
@pytest.mark.mpi
def test_a_list_of_tensors_with_an_op_that_cannot_be_combined_locally_is_refused(pg):
    """all_reduce of several tensors reduces them locally first; AVG cannot be, so every rank refuses it alike,
    before any communication (the group stays usable)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = R.AVG
    errors = run_gathered(lambda: _error_of(lambda: pg.allreduce([torch.ones(2), torch.ones(2)], opts)))
    assert all(e.startswith("NotImplementedError") and "list of 2 tensors with ReduceOp.AVG" in e for e in errors)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(SIZE)] * 2


@pytest.mark.mpi
@multi
def test_failure_raises_from_the_call_from_wait_and_through_the_future(pg):
    """A barrier only rank 0 enters: its timeout raises from dist.barrier(); later calls on the broken group raise
    too (from wait() and get_future()); destroying the group warns on every rank that its MPI communicators
    stay allocated (messages were left behind)."""
    group = dist.new_group(timeout=timedelta(seconds=1))

    def rank0():
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError, match=" timeout "):
            dist.barrier(group=group)
        assert time.monotonic() - start > 0.9
        work = dist.all_reduce(torch.ones(2), group=group, async_op=True)
        with pytest.raises(dist.DistBackendError, match="unusable"):
            work.wait()
        with pytest.raises(Exception, match="unusable"):
            dist.all_reduce(torch.ones(2), group=group, async_op=True).get_future().wait()

    fail_on_rank0_then_destroy(group, rank0)


@pytest.mark.mpi
@multi
def test_clean_group_is_freed_without_warning(pg):
    group = dist.new_group()
    in_step(lambda: dist.all_reduce(torch.ones(1), group=group))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        in_step(lambda: dist.destroy_process_group(group))
    assert not [w for w in caught if "without freeing" in str(w.message)]


@pytest.mark.mpi
@multi
def test_barrier_timeout_argument_bounds_the_call(pg):
    """dist.barrier(timeout=...) on rank 0 alone raises after that long; the barrier goes on and completes once
    the others arrive, and the group stays usable."""
    if RANK == 0:
        start = time.monotonic()
        with pytest.raises(dist.DistBackendError, match="Timed out waiting 300ms"):
            dist.barrier(timeout=timedelta(milliseconds=300))
        assert time.monotonic() - start < 20
    in_step(lambda: None)
    if RANK != 0:
        dist.barrier()
    t = torch.full((3,), float(RANK))
    in_step(lambda: dist.all_reduce(t))
    assert t.tolist() == [float(sum(range(SIZE)))] * 3


@pytest.mark.mpi
@multi
def test_collectives_pair_in_issue_order_whatever_async_op(pg):
    """Even ranks issue A asynchronously and B synchronously, odd ranks the reverse: A still meets A."""
    a, b = torch.full((4,), float(RANK)), torch.full((4,), 100.0 + RANK)
    first_async = RANK % 2 == 0

    def run():
        work = dist.all_reduce(a, async_op=first_async)
        second = dist.all_reduce(b, async_op=not first_async)
        for w in (work, second):
            if w is not None:
                w.wait()

    in_step(run)
    assert a.tolist() == [float(sum(range(SIZE)))] * 4
    assert b.tolist() == [100.0 * SIZE + sum(range(SIZE))] * 4


@pytest.mark.mpi
@multi
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_collectives_pair_in_issue_order_where_native_starts_persistent_requests(pg, monkeypatch, dtype):
    """Where native would start a persistent request for an all-reduce (forced here at every size; the shipped
    profiles do so for small ones), a group's calls start none: its synchronous call runs the C++ all-reduce's
    Iallreduce, which would never pair with a persistent one started for the queued asynchronous call. Even ranks
    issue A asynchronously and B synchronously, odd ranks the reverse, and A still meets A, three times (from the
    second, in the plans' express calls), on a new group made under that profile. (int64: reduced by MPI's own op
    on either library, the C++ all-reduce's case.)"""
    profile = forced("persistent")
    monkeypatch.setattr(native, "library", lambda: profile)
    group = dist.new_group(timeout=timedelta(seconds=20))  # (what a pairing gone wrong would wait at most)
    a, b = torch.full((4,), RANK, dtype=dtype), torch.full((4,), 100 + RANK, dtype=dtype)
    first_async = RANK % 2 == 0

    def run():
        for _ in range(3):
            a.fill_(RANK)
            b.fill_(100 + RANK)
            work = dist.all_reduce(a, group=group, async_op=first_async)
            second = dist.all_reduce(b, group=group, async_op=not first_async)
            for w in (work, second):
                if w is not None:
                    w.wait()
        return [made for made in backend_of(group).comm.transport.persistent_requests.values() if made]

    try:
        made = in_step(run)
    finally:
        in_step(lambda: dist.destroy_process_group(group))
    assert a.tolist() == [sum(range(SIZE))] * 4
    assert b.tolist() == [100 * SIZE + sum(range(SIZE))] * 4
    assert made == [], f"a persistent request was made: {made}"


@pytest.mark.mpi
@multi
def test_queued_collectives_progress_without_wait(pg):
    """What DDP's overlap needs: async all-reduces complete while the caller only polls is_completed()."""
    tensors = [torch.full((1 << 18,), float(RANK + i)) for i in range(3)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    deadline = time.monotonic() + 60
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(w.is_completed() for w in works), "queued collectives made no progress without wait()"
    for i, t in enumerate(tensors):
        assert torch.all(t == float(sum(range(SIZE)) + SIZE * i))


@pytest.mark.mpi
@multi
def test_synchronous_calls_start_no_thread(pg):
    group = dist.new_group()
    t = torch.ones(8)
    in_step(lambda: [dist.all_reduce(t, group=group) for _ in range(5)])
    in_step(lambda: dist.broadcast(t, src=0, group=group))
    workers = [th for th in threading.enumerate() if th.name == f"mpcomm-torch-{group.group_name}"]
    assert not workers, "a synchronous call went through the worker thread"
    in_step(lambda: dist.all_reduce(t, group=group, async_op=True).wait())
    assert [th for th in threading.enumerate() if th.name == f"mpcomm-torch-{group.group_name}"]
    in_step(lambda: dist.destroy_process_group(group))


@pytest.mark.mpi
@multi
def test_group_names_and_descriptions(pg):
    sub = dist.new_group(list(range(SIZE)), group_desc="mine")
    assert pg.group_name and sub.group_name and pg.group_name != sub.group_name
    assert (pg.group_desc, sub.group_desc) == ("default_pg", "mine")
    assert dist.distributed_c10d._resolve_process_group(sub.group_name) is sub
    in_step(lambda: dist.destroy_process_group(sub))


@pytest.mark.mpi
@multi
def test_sub_group_in_reverse_order(pg):
    """new_group(sort_ranks=False): group rank i is ranks[i]."""
    ranks = list(reversed(range(SIZE)))
    group = dist.new_group(ranks, sort_ranks=False)
    assert dist.get_rank(group) == ranks.index(RANK)
    t = torch.full((2,), float(RANK))
    in_step(lambda: dist.broadcast(t, group_src=0, group=group))  # group rank 0 = the last global rank
    assert t.tolist() == [float(SIZE - 1)] * 2


@pytest.mark.mpi
@multi
def test_receive_of_the_wrong_size_raises(pg):
    def run():
        if RANK == 0:
            dist.send(torch.ones(3), dst=1)
        elif RANK == 1:
            with pytest.raises(ValueError, match="sizes and dtypes must match"):
                dist.recv(torch.ones(4), src=0)

    in_step(run)


@pytest.mark.mpi
@multi
def test_bad_arguments_raise_the_same_error_on_every_rank(pg):
    errors = run_gathered(lambda: _error_of(lambda: dist.all_reduce(torch.ones(2), op=R.BAND)))
    assert all("BAND needs an integral" in e for e in errors)
    errors = run_gathered(lambda: _error_of(lambda: dist.all_gather_single(torch.empty(SIZE + 1), torch.ones(1))))
    assert all("output has" in e for e in errors)
    errors = run_gathered(lambda: _error_of(lambda: dist.all_reduce(torch.ones(2),
                                                                    op=dist._make_nccl_premul_sum(2.0))))
    assert all(e.startswith("NotImplementedError") and "PREMUL_SUM" in e for e in errors)
    t = torch.ones(4)  # the group is still usable
    in_step(lambda: dist.all_reduce(t))
    assert t.tolist() == [float(SIZE)] * 4


def _error_of(call) -> str:
    try:
        call()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# ---------------------------------------------------------------------------------------------- beyond gloo
@pytest.mark.mpi
@multi
def test_uneven_all_gather(pg):
    """Sizes differ per rank (gloo aborts the process on this)."""
    outputs = [torch.full((r + 1,), -1.0) for r in range(SIZE)]
    in_step(lambda: dist.all_gather(outputs, torch.arange(RANK + 1, dtype=torch.float32) + 10 * RANK))
    for r, out in enumerate(outputs):
        assert out.tolist() == [10.0 * r + i for i in range(r + 1)]


@pytest.mark.mpi
@multi
def test_all_to_all_lists_of_different_sizes(pg):
    """Rank i sends j + 1 rows... to rank j (sizes differ per pair), reference computed from the formula."""
    inputs = [torch.full((j + 1, 2), float(10 * RANK + j)) for j in range(SIZE)]
    outputs = [torch.zeros(RANK + 1, 2) for _ in range(SIZE)]
    in_step(lambda: dist.all_to_all(outputs, inputs))
    for i, out in enumerate(outputs):
        assert torch.all(out == float(10 * i + RANK))


@pytest.mark.mpi
@multi
def test_strided_tensors(pg):
    m = torch.arange(12.0).reshape(4, 3) + RANK
    column = m[:, 1]
    in_step(lambda: dist.all_reduce(column))
    expected = sum(torch.arange(12.0).reshape(4, 3)[:, 1] + r for r in range(SIZE))
    assert torch.equal(m[:, 1], expected) and torch.equal(m[:, 0], torch.arange(0.0, 12.0, 3) + RANK)
    rows = [torch.zeros(2, 3)[:, 0] for _ in range(SIZE)]
    in_step(lambda: dist.all_gather(rows, torch.full((2,), float(RANK))))
    assert [r.tolist() for r in rows] == [[float(r)] * 2 for r in range(SIZE)]


@pytest.mark.mpi
@multi
def test_float8_moves_as_bytes(pg):
    source = torch.tensor([0.5, -2.0, 448.0]).to(torch.float8_e4m3fn)
    t = source.clone() if RANK == 0 else torch.zeros(3, dtype=torch.float8_e4m3fn)
    in_step(lambda: dist.broadcast(t, src=0))
    assert torch.equal(t.view(torch.uint8), source.view(torch.uint8))
    errors = run_gathered(lambda: _error_of(lambda: dist.all_reduce(t)))
    assert all("cannot be reduced" in e for e in errors)


@pytest.mark.mpi
@multi
def test_complex_all_reduce(pg):
    t = torch.tensor([1 + 2j, -3j], dtype=torch.complex64) * (RANK + 1)
    in_step(lambda: dist.all_reduce(t))
    total = SIZE * (SIZE + 1) // 2
    assert t.tolist() == [complex(total, 2 * total), complex(0, -3 * total)]


@pytest.mark.mpi
@multi
def test_sparse_all_reduce(pg):
    def entries(r):  # rank r's nonzeros; ranks share some positions (summed), rank 0 and 1 share (0, 1) twice
        return [((0, r), 1.0), ((r % 3, 1), 2.0 * (r + 1))]

    mine = entries(RANK)
    t = torch.sparse_coo_tensor(torch.tensor([ij for ij, _ in mine]).T, torch.tensor([v for _, v in mine]),
                                (3, SIZE + 1), check_invariants=True)
    dense = torch.zeros(3, SIZE + 1)
    for r in range(SIZE):
        for (i, j), v in entries(r):
            dense[i, j] += v
    in_step(lambda: dist.all_reduce(t))
    assert t.is_sparse and torch.equal(t.to_dense(), dense)
    errors = run_gathered(lambda: _error_of(lambda: dist.all_reduce(t, op=R.MAX)))
    assert all(e.startswith("NotImplementedError") and "sparse" in e for e in errors)


@pytest.mark.mpi
@multi
def test_monitored_barrier(pg):
    """On the group (dist.monitored_barrier refuses non-gloo names): passes when all arrive; names the missing
    ranks when they do not."""
    in_step(lambda: pg.monitored_barrier(timedelta(seconds=30)))
    group = dist.new_group()

    def rank0():
        with pytest.raises(RuntimeError, match=f"Ranks {', '.join(map(str, range(1, SIZE)))} failed to pass "
                                               "monitoredBarrier in 500 ms"):
            group.monitored_barrier(timedelta(milliseconds=500), wait_all_ranks=True)
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier after 0 ms"):
            group.monitored_barrier(timedelta(seconds=0))

    in_step(rank0 if RANK == 0 else lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failed group is left allocated (see the failure test)
        in_step(lambda: dist.destroy_process_group(group))


@pytest.mark.mpi
@multi
def test_device_mesh_groups(pg):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = in_step(lambda: init_device_mesh("cpu", (SIZE,), mesh_dim_names=("dp",)))
    group = mesh.get_group("dp")
    assert group.group_name and dist.get_backend(group) == "mpcomm"
    t = torch.full((2,), float(RANK))
    in_step(lambda: dist.all_reduce(t, group=group))
    assert t.tolist() == [float(sum(range(SIZE)))] * 2


@pytest.mark.mpi
@multi
def test_functional_collectives(pg):
    """torch's functional collectives (what DTensor runs) reach the group through C++; each equals the
    dist.* call on the same input."""
    import torch.distributed._functional_collectives as funcol

    x = torch.arange(2.0 * SIZE) + 10 * RANK

    def check():
        reduced = x.clone()
        dist.all_reduce(reduced)
        assert torch.equal(funcol.all_reduce(x, "sum", pg).wait(), reduced)
        gathered = torch.empty(2 * SIZE * SIZE)
        dist.all_gather_single(gathered, x)
        assert torch.equal(funcol.all_gather_tensor(x, 0, pg).wait(), gathered)
        scattered = torch.empty(2)
        dist.reduce_scatter_single(scattered, x)
        assert torch.equal(funcol.reduce_scatter_tensor(x, "sum", 0, pg).wait(), scattered)
        exchanged = torch.empty_like(x)
        dist.all_to_all_single(exchanged, x)
        assert torch.equal(funcol.all_to_all_single(x, None, None, pg).wait(), exchanged)
        assert torch.equal(funcol.broadcast(x, SIZE - 1, pg).wait(), torch.arange(2.0 * SIZE) + 10 * (SIZE - 1))

    in_step(check)


@pytest.mark.mpi
@multi
def test_monitored_barrier_helper(pg):
    """mpcomm.integrations.torch.monitored_barrier: dist.monitored_barrier's signature, for mpcomm groups."""
    in_step(lambda: mpt.monitored_barrier(timeout=timedelta(seconds=30)))
    group = dist.new_group()
    in_step(lambda: mpt.monitored_barrier(group, timedelta(seconds=30), wait_all_ranks=True))
    with pytest.raises(ValueError, match="dist.monitored_barrier"):
        mpt.monitored_barrier(object())
