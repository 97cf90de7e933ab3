"""A Communicator after a failure and after free(): an MPI error or a collective that stopped midway makes it refuse
every further collective (stale messages must never match a later call); free() is collective and keeps the MPI
communicators when any rank saw a failure; every call after free() says it was freed.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_unusable.py`` (any N >= 1).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import WORLD, run_gathered

from mpcomm import CommTimeoutError, Communicator, MpcommError
from mpcomm.algorithms import REGISTRY

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()


def test_mpi_library_errors_become_mpcomm_errors_and_poison(monkeypatch):
    """An MPI error raised by the library inside a collective (here: a send to a rank that does not exist) is an
    MpcommError naming the call, and the communicator refuses further collectives, barrier() included."""
    monkeypatch.setitem(REGISTRY["allreduce"], "to_nowhere",
                        lambda t, buf, op: t.wait([t.mpi.Isend(buf, t.size + 3)], t.others))
    c = Communicator(WORLD, timeout=5.0)

    def run():
        with pytest.raises(MpcommError, match=r"allreduce\[to_nowhere\]") as info:
            c.allreduce(np.ones(4), algorithm="to_nowhere")
        assert not isinstance(info.value, CommTimeoutError)
        for call in (lambda: c.barrier(), lambda: c.allreduce(np.ones(4), algorithm="ring")):
            with pytest.raises(MpcommError, match="unusable"):
                call()

    try:
        run_gathered(run)
    finally:
        c.free()


def test_barrier_is_refused_after_a_collective_stopped_midway():
    if P < 2:
        pytest.skip("needs a silent rank")
    c = Communicator(WORLD, timeout=1.0)

    def run():
        if RANK != P - 1:
            with pytest.raises(CommTimeoutError):
                c.allreduce(np.ones(4), algorithm="ring")
            start = time.monotonic()
            with pytest.raises(MpcommError, match="unusable"):
                c.barrier()
            assert time.monotonic() - start < 0.5  # refused at once, not another timeout

    try:
        run_gathered(run)
    finally:
        c.free()


def test_free_keeps_the_mpi_communicators_when_any_rank_saw_a_failure():
    """free() is collective: the ranks agree whether any of them saw a failure (here only the ranks that waited
    for a silent one did). If so none frees its MPI communicators (MPI would give their contexts to the next
    communicator, which could match the messages left in flight), and a Communicator made next works; a clean
    one is freed everywhere."""
    if P < 2:
        pytest.skip("needs a silent rank")
    failing, clean = Communicator(WORLD, timeout=1.0), Communicator(WORLD, timeout=5.0)

    def run():
        if RANK != P - 1:
            with pytest.raises(CommTimeoutError):
                failing.allreduce(np.ones(2**16), algorithm="ring")
        return failing.free(), clean.free()

    outcomes = run_gathered(run)
    fresh = Communicator(WORLD, timeout=10.0)
    try:
        results = run_gathered(lambda: [fresh.allreduce(np.full(2**16, RANK + 1.0), algorithm="ring")
                                        for _ in range(5)])
    finally:
        fresh.free()
    assert outcomes == [(False, True)] * P, outcomes
    assert all((r == P * (P + 1) / 2).all() for rank_results in results for r in rank_results)


def test_use_after_free_is_an_mpcomm_error(tmp_path):
    """Every entry point after free() raises an MpcommError saying so (not mpi4py's "Invalid communicator", nor
    the executor's "cannot schedule new futures after shutdown" once the progress thread has run)."""
    c = Communicator(WORLD, timeout=5.0)
    c.iallreduce(np.ones(2)).wait()  # the progress thread exists
    c.free()
    c.free()  # twice is fine
    calls = {
        "allreduce": lambda: c.allreduce(np.ones(3)),
        "barrier": lambda: c.barrier(),
        "send": lambda: c.send(np.ones(3), 0),
        "recv": lambda: c.recv(np.ones(3), 0),
        "irecv": lambda: c.irecv(np.ones(3), 0),
        "sendrecv": lambda: c.sendrecv(np.ones(3), 0, np.ones(3), 0),
        "split": lambda: c.split(0),
        "reduce": lambda: c.reduce(np.ones(3), np.ones(3), root=0),
        "all_to_all_v": lambda: c.all_to_all_v(np.ones(P), [1] * P, np.ones(P), [1] * P),
        "iallreduce": lambda: c.iallreduce(np.ones(3)).wait(),
        "ibarrier": lambda: c.ibarrier().wait(),
        "iall_gather": lambda: c.iall_gather(np.ones(1), np.ones(P)).wait(),
        "load_tuning": lambda: c.load_tuning(str(tmp_path / "missing.json"), missing_ok=True),
    }
    for name, call in calls.items():
        with pytest.raises(MpcommError, match="freed"):
            call()
