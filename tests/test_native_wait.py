"""``native``'s ways of waiting for the MPI library's all-reduce within the deadline (``mpcomm.mpi_library``), each
forced at every size on whichever library runs the tests: results against numpy and bitwise identical across
ranks, a rank that never comes times out, ranks that disagree on the count are told so on every rank, and the
persistent requests are kept per (count, dtype, op) and freed with the communicator.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_native_wait.py`` (any N >= 1).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import WORLD, gather, in_step, make_input
from mpi4py import MPI
from test_collectives import LARGE, LARGE_CASES, PAIRS, check_allreduce, pair_id, small_sizes
from test_timeouts import TIMEOUT, assert_every_waiting_rank_timed_out, with_silent_rank

from mpcomm import Communicator
from mpcomm.algorithms import native
from mpcomm.errors import CollectiveMismatchError
from mpcomm.mpi_library import WAYS, forced, library
from mpcomm.transport import Transport

pytestmark = pytest.mark.mpi

P = WORLD.Get_size()


@pytest.fixture(params=list(WAYS))
def way(request, monkeypatch) -> str:
    """native waits in this way at every size (the same on every rank: the parameters run in the same order)."""
    profile = forced(request.param)
    monkeypatch.setattr(native, "library", lambda: profile)
    return request.param


@pytest.mark.parametrize("dtype,op", PAIRS, ids=map(pair_id, PAIRS))
def test_allreduce_every_dtype_and_op(comm, way, dtype, op):
    check_allreduce(comm, "native", dtype, op, [(n,) for n in small_sizes(comm.size)])


@pytest.mark.parametrize("dtype,op", LARGE_CASES, ids=map(pair_id, LARGE_CASES))
def test_allreduce_large(comm, way, dtype, op):
    check_allreduce(comm, "native", dtype, op, [(LARGE,)], seed=100)


@pytest.mark.mpi(min_size=2)
def test_a_silent_rank_times_out(way):
    comm = Communicator(WORLD, timeout=TIMEOUT)
    try:
        silence = with_silent_rank(comm, lambda c, _: c.allreduce(np.ones(8), algorithm="native"))
    finally:
        comm.free()
    assert_every_waiting_rank_timed_out(silence, ["allreduce[native]"])


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_the_count_are_told_on_every_rank(monkeypatch):
    """meet+blocking: the meeting compares counts before the blocking call, so no rank enters it to wait for a
    call that does not match; nothing was sent, so the communicator stays usable."""
    profile = forced("meet+blocking")
    monkeypatch.setattr(native, "library", lambda: profile)
    comm = Communicator(WORLD)
    try:
        def disagree():
            try:
                comm.allreduce(np.ones(8 if comm.rank == 0 else 9), algorithm="native")
            except CollectiveMismatchError as exc:
                return str(exc)
            return None

        messages = WORLD.allgather(disagree())
        after = in_step(lambda: comm.allreduce(np.ones(5), algorithm="native"))
    finally:
        comm.free()
    for rank, message in enumerate(messages):
        assert message is not None, f"rank {rank} did not raise CollectiveMismatchError"
        assert "different counts" in message and f"rank {rank}" in message, message
    assert (after == P).all()


def test_persistent_requests_are_kept_per_kind_and_freed(monkeypatch):
    """Past the number kept, all are freed and made again (every rank alike): results stay right throughout."""
    profile = forced("persistent")
    monkeypatch.setattr(native, "library", lambda: profile)
    comm = Communicator(WORLD)
    kept = comm._sync.persistent_requests
    counts = range(1, native._PERSISTENT_KEPT + 10)
    try:
        def run():
            results = []
            for n in counts:
                x = make_input(np.float64, "sum", (n,), comm.rank, seed=n)
                y = comm.allreduce(x.copy(), algorithm="native")
                results.append((x, y, len(kept)))
            comm.allreduce(np.ones(counts[-1]), algorithm="native")  # a kind kept already: no new request
            return results, len(kept)

        mine, size_after = in_step(run)
        everyone = gather(np.concatenate([y for _, y, _ in mine]))
        inputs = gather(np.concatenate([x for x, _, _ in mine]))
    finally:
        comm.free()
    assert max(n for _, _, n in mine) <= native._PERSISTENT_KEPT
    assert size_after == len(counts) - native._PERSISTENT_KEPT if P > 1 else size_after == 0
    np.testing.assert_allclose(everyone[0], np.sum(inputs, axis=0), rtol=1e-12)
    assert all(e.tobytes() == everyone[0].tobytes() for e in everyone)
    assert kept == {}, "free() left persistent requests behind"


def test_the_blocking_way_is_left_where_ranks_share_cores():
    """A blocking call spins: the shipped profiles meet and block only where no rank shares its core; a forced
    meet+blocking (benchmarks, the tests above) blocks everywhere."""
    t = Transport(MPI.COMM_SELF, 5.0)
    shipped = replace(library(), blocking_above=1024)
    assert native.meets_then_blocks(t, shipped, 1025) and not native.meets_then_blocks(t, shipped, 1024)
    t.share_cores()
    assert not native.meets_then_blocks(t, shipped, 1 << 20)
    assert native.meets_then_blocks(t, forced("meet+blocking"), 8)
    assert not native.meets_then_blocks(t, forced("nonblocking"), 1 << 20)

