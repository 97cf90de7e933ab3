"""The dispatch seam's public API (``mpcomm.dispatch``, docs/dispatch.md): plan, run, transport, the object
collectives, protocol channels and the footprint, checked against numpy on every rank's inputs.

    python -m pytest -q --with-mpi tests/test_dispatch.py
    timeout 600 mpiexec -n 3 python -m pytest -q --with-mpi -m mpi tests/test_dispatch.py   (also 2, 4)
"""
from __future__ import annotations

import numpy as np
import pytest

from mpcomm import Communicator, MpcommError
from mpcomm.plan import Plan

from conftest import WORLD, assert_bitwise_equal, gather, in_step, run_gathered

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("count", [0, 1, 7, 1000])
def test_a_plan_run_by_hand_is_the_allreduce(comm, count):
    mine = np.arange(count, dtype=np.float64) * (comm.rank + 1) + 0.5
    expected = np.sum(np.stack(gather(mine)), axis=0)
    plan = in_step(lambda: comm.plan("allreduce", mine, op="sum", algorithm="ring"))
    assert plan is comm.plan("allreduce", mine, op="sum", algorithm="ring")  # cached
    before = comm.stats().get("allreduce", {}).get("ring", {}).get("calls", 0)
    out = mine.copy()
    in_step(lambda: comm.run(plan, out, plan.rop))
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert_bitwise_equal(gather(out))
    assert comm.stats()["allreduce"]["ring"]["calls"] == before + 1


def test_plan_checks_its_arguments_locally(comm):
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        comm.plan("allreduce", np.zeros(3), op="sum", algorithm="nope")
    with pytest.raises(TypeError, match="avg"):
        comm.plan("allreduce", np.zeros(3, dtype=np.int32), op="avg")


def test_a_plan_running_another_function_keeps_its_label_and_stats_key(comm):
    plan = comm.plan("allreduce", np.zeros(4), op="sum", algorithm="native")
    seen = []
    other = plan.running(lambda t, *buffers: seen.append(len(buffers)))
    assert other.fn is not plan.fn and other.key == plan.key and str(other.label) == str(plan.label)
    in_step(lambda: comm.run(other, np.zeros(4), other.rop))
    assert seen == [2]


def test_objects_are_shared_in_rank_order_and_from_any_root(comm):
    assert in_step(lambda: comm.allgather_object({"rank": comm.rank})) == [{"rank": r} for r in range(comm.size)]
    root = comm.size - 1
    assert in_step(lambda: comm.bcast_object(("from", comm.rank), root=root)) == ("from", root)
    gathered = in_step(lambda: comm.transport.gather_object({"rank": comm.rank}, root=root))
    assert gathered == ([{"rank": r} for r in range(comm.size)] if comm.rank == root else None)


def test_bcast_object_refuses_a_root_that_is_no_rank(comm):
    with pytest.raises(ValueError, match="root 99 is not a rank"):
        comm.bcast_object(1, root=99)


def test_protocol_transport_is_made_once_per_name_and_freed_with_the_communicator():
    c = Communicator(WORLD, timeout=30)
    try:
        first = in_step(lambda: c.protocol_transport("test protocol"))
        assert c.protocol_transport("test protocol") is first  # no second meeting: local
        assert first.mpi.Get_size() == c.size and first.mpi != c.transport.mpi
    finally:
        assert in_step(c.free)
    with pytest.raises(MpcommError, match="freed"):
        c.bcast_object(1)


def test_the_footprint_counts_what_is_kept(comm):
    c = Communicator(WORLD, timeout=30)
    try:
        empty = c.footprint()
        assert empty["plans"] == 0 and empty["records"] == 0
        for n in (1, 2, 3):
            run_gathered(lambda: c.allreduce(np.ones(n)))
        assert c.footprint()["plans"] == 3 and c.footprint()["records"] >= 1
    finally:
        in_step(c.free)


def test_an_allreduce_like_the_last_runs_the_choice_of_a_table_loaded_since(tmp_path):
    """The last all-reduce's plan, taken again for a call like it, is dropped when auto's choices change: after
    load_tuning() the same kind of array (a new one, of an equal shape) runs the algorithm the table chose."""
    c, other = Communicator(WORLD, timeout=30), Communicator(WORLD, timeout=30)
    try:
        x = np.arange(8, dtype=np.float32) + c.rank
        expected = np.sum(np.stack(gather(x)), axis=0)
        first = c.selector.choose("allreduce", x.nbytes, x.dtype, "sum")
        tuned = "tree" if first != "tree" else "ring"
        in_step(lambda: other.tune(sizes=(x.nbytes,), repeats=1, algorithms=(tuned,), verbose=False))
        in_step(lambda: other.save_tuning(str(tmp_path / "tuned.json")))
        for _ in range(2):  # (the second finds the plan in the cache, and keeps it as the last)
            np.testing.assert_array_equal(in_step(lambda: c.allreduce(x.copy())), expected)
        assert in_step(lambda: c.load_tuning(str(tmp_path / "tuned.json")))
        for _ in range(2):
            np.testing.assert_array_equal(in_step(lambda: c.allreduce(x.copy())), expected)
        assert {name: record["calls"] for name, record in c.stats()["allreduce"].items()} == {first: 2, tuned: 2}
    finally:
        for comm in (c, other):
            in_step(comm.free)


def test_stats_count_every_call_after_a_reset_and_a_tuning():
    """reset_stats() and tune() leave the counts that a plan's express call (one C call, p > 1) keeps in its stats
    entry right: the calls after a reset are counted, tune()'s own are not, the earlier ones are kept."""
    c = Communicator(WORLD, timeout=30)
    try:
        x = np.ones(8, dtype=np.float32)
        chosen = c.selector.choose("allreduce", x.nbytes, x.dtype, "sum")
        for _ in range(3):
            in_step(lambda: c.allreduce(x))
        assert c.stats()["allreduce"][chosen]["calls"] == 3
        c.reset_stats()
        assert c.stats() == {}
        for _ in range(2):
            in_step(lambda: c.allreduce(x))
        assert {name: (record["calls"], record["bytes"]) for name, record in c.stats()["allreduce"].items()} == \
            {chosen: (2, 64)} and list(c.stats()) == ["allreduce"]
        in_step(lambda: c.tune(sizes=(x.nbytes,), repeats=1, algorithms=(chosen, "ring"), verbose=False))
        assert {name: record["calls"] for name, record in c.stats()["allreduce"].items()} == {chosen: 2}
    finally:
        in_step(c.free)


def test_every_collective_goes_through_run(monkeypatch):
    """The seam a recorder hooks: blocking, non-blocking and the meetings all enter Communicator.run."""
    c = Communicator(WORLD, timeout=30)
    seen: list[str] = []
    original = Communicator.run

    def recording(self, plan: Plan, *buffers, **kwargs):
        seen.append(plan.operation)
        return original(self, plan, *buffers, **kwargs)

    monkeypatch.setattr(Communicator, "run", recording)
    try:
        x = np.ones(5)
        in_step(lambda: c.allreduce(x))
        in_step(lambda: c.broadcast(x, root=0))
        in_step(lambda: c.iallreduce(x).wait())
        in_step(c.barrier)
        in_step(lambda: c.all_gather(x, np.empty(5 * c.size)))
    finally:
        monkeypatch.undo()
        in_step(c.free)
    assert seen == ["allreduce", "broadcast", "allreduce", "barrier", "all_gather"], seen
