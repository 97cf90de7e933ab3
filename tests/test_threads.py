"""One Communicator and several threads: a call made while another thread's collective of the same Communicator
runs is refused (and the communicator becomes unusable), never silently wrong; one thread after another is fine.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_threads.py`` (any N >= 1).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import WORLD, run_gathered

from mpcomm import Communicator, MpcommError

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()


@pytest.mark.parametrize("second", ["ring", "native express"])
def test_second_thread_during_a_collective_is_refused_and_nothing_is_wrong(second):
    """Thread A is inside an all-reduce (ranks > 0 wait in it for rank 0, held back) when thread B calls one on
    the same Communicator: B is refused at once with MpcommError, and A — whose call may now pair with the wrong
    one elsewhere — raises too (the communicator became unusable). Rank 0, whose only call is A's, gets the
    right sum. Before: 170 of 200 ring all-reduces from two threads returned wrong values with no error.
    (Two threads that take turns without overlapping are the program's to order: see docs/safety.md.)
    ``second``: B's call is a ring all-reduce, or a small native one whose plan is made (its express C call,
    which takes the lock in C)."""
    if P < 2:
        pytest.skip("needs a peer to hold the first call open")
    c = Communicator(WORLD, timeout=10.0)
    outcome = {}
    small = np.ones(8)
    if second == "native express":
        c.allreduce(small, algorithm="native")  # (B's call's plan is made, on every rank)

    def thread_a():
        buf = np.full(1000, RANK + 1.0)
        try:
            c.allreduce(buf, algorithm="ring")
            outcome["A"] = "right" if (buf == P * (P + 1) / 2).all() else f"WRONG {buf[0]}"
        except MpcommError as exc:
            outcome["A"] = f"MpcommError: {exc}"

    go = [WORLD.irecv(source=r, tag=77) for r in range(1, P)] if RANK == 0 else None
    a = threading.Thread(target=thread_a, name="A")
    if RANK == 0:  # rank 0 joins only once every other rank's thread B has been refused
        deadline = time.monotonic() + 30
        while not all(r.Test() for r in go) and time.monotonic() < deadline:
            time.sleep(0.001)
        a.start()
    else:
        a.start()
        deadline = time.monotonic() + 30
        while not c._sync.in_use.locked() and time.monotonic() < deadline:  # A is inside its collective
            time.sleep(0.001)
        try:
            if second == "ring":
                c.allreduce(np.ones(1000), algorithm="ring")
            else:
                c.allreduce(small, algorithm="native")
            outcome["B"] = "completed"
        except MpcommError as exc:
            outcome["B"] = f"MpcommError: {exc}"
        WORLD.send("refused", dest=0, tag=77)
    a.join()
    c.free()
    everyone = run_gathered(lambda: outcome)
    assert everyone[0] == {"A": "right"}, everyone
    for r in range(1, P):
        assert everyone[r]["B"].startswith("MpcommError") and "thread 'MainThread'" in everyone[r]["B"], everyone
        assert everyone[r]["A"].startswith("MpcommError"), everyone


def test_one_thread_after_another_is_fine(comm):
    """Handing a Communicator from one thread to another (not at the same time) is allowed."""
    results = []

    def worker():
        results.append(comm.allreduce(np.full(3, RANK + 1.0)))

    for _ in range(2):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    run_gathered(lambda: None)
    assert all((r == P * (P + 1) / 2).all() for r in results)
