"""Point-to-point receives from any source / with any tag, and the envelope protocol under them: a receive learns
who sent (``Status``, ``Work.source``/``tag``), wildcard and specific receives on one tag never take each other's
payloads, senders that wait before their receiver does never deadlock, and a mismatch leaves nothing in flight.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_p2p_wildcards.py`` (any N >= 1).
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import WORLD, run_gathered

import mpcomm
from mpcomm import ANY_SOURCE, ANY_TAG, CommTimeoutError, Communicator, Status
from mpcomm.p2p import INLINE_BYTES

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()
SIZES = [1, INLINE_BYTES // 8, INLINE_BYTES // 8 + 1, 2**16 + 3]  # inline, largest inline, payload, rendezvous


@pytest.mark.parametrize("count", SIZES)
def test_any_source_any_tag_reports_who_sent(comm, count):
    """Every other rank sends rank 0 its rank number under tag 100 + rank; rank 0 receives them all with
    ANY_SOURCE/ANY_TAG and learns each message's source and tag from the Status (and the Work)."""

    def run():
        if RANK != 0:
            comm.send(np.full(count, RANK, np.int64), 0, tag=100 + RANK)
            return None
        seen = []
        for _ in range(P - 1):
            buf, status = np.zeros(count, np.int64), Status()
            returned = comm.recv(buf, ANY_SOURCE, ANY_TAG, status=status)
            seen.append((status.source, status.tag, status.count, int(buf[0]), bool((buf == buf[0]).all()),
                         returned is buf))
        work = comm.irecv(np.zeros(count, np.int64), ANY_SOURCE, ANY_TAG) if P > 1 else None
        if work is not None:
            comm.send(np.full(count, 7, np.int64), 0, tag=5)  # to itself: the Work reports it too
            work.wait()
            seen.append((work.source, work.tag, None, None, True, True))
        return seen

    seen = run_gathered(run)[0]
    assert sorted(s[:4] for s in seen[: P - 1]) == [(r, 100 + r, count, r) for r in range(1, P)]
    assert all(s[4] and s[5] for s in seen)
    if P > 1:
        assert seen[-1][:2] == (0, 5)


@pytest.fixture
def pair():
    """A Communicator of its own (20 s timeout) for a test of rank 1 sending to rank 0, freed after it."""
    if P < 2:
        pytest.skip("needs a sender")
    c = Communicator(WORLD, timeout=20.0)
    yield c
    c.free()


@pytest.mark.parametrize("wildcard_first", [True, False])
@pytest.mark.parametrize("count", [3, 2**16 + 3])
def test_wildcard_and_specific_receives_keep_their_own_payloads(pair, wildcard_first, count):
    """Rank 0 posts one wildcard and one specific receive for the same tag; rank 1 sends two messages. MPI
    matches envelopes in posting order, and each receive must get the payload of the envelope it matched."""
    c = pair

    def run():
        if RANK == 1:
            c.send(np.full(count, 1.0), 0, tag=4)
            c.send(np.full(count, 2.0), 0, tag=4)
        if RANK != 0:
            return None
        first, second = np.zeros(count), np.zeros(count)
        posts = [(first, ANY_SOURCE), (second, 1)] if wildcard_first else [(first, 1), (second, ANY_SOURCE)]
        works = [c.irecv(buf, src, tag=4) for buf, src in posts]
        for work in reversed(works):  # completion order must not matter
            work.wait()
        return first, second, [w.source for w in works]

    first, second, sources = run_gathered(run)[0]
    assert (first == 1.0).all() and (second == 2.0).all() and sources == [1, 1]


@pytest.mark.parametrize("count", [5, 2**17])
def test_senders_that_wait_first_do_not_deadlock(comm, count):
    """Both partners wait on their send before their receive (large messages are rendezvous sends): the sender's
    wait must open the envelope of the receive already posted, or both would wait forever."""
    partner = RANK ^ 1 if (RANK ^ 1) < P else RANK

    def run():
        got = np.zeros(count)
        receiving = comm.irecv(got, partner, tag=8)
        sending = comm.isend(np.full(count, float(RANK)), partner, tag=8)
        sending.wait()
        receiving.wait()
        exchanged = comm.sendrecv(np.full(count, RANK + 0.5), partner, np.zeros(count), partner, tag=9)
        return got, exchanged

    for r, (got, exchanged) in enumerate(run_gathered(run)):
        partner_of_r = r ^ 1 if (r ^ 1) < P else r
        assert (got == partner_of_r).all() and (exchanged == partner_of_r + 0.5).all()


def test_posted_large_receive_progresses_inside_a_collective(comm):
    """Rank 1 sends rank 0 a large message and waits for it; rank 0 has posted the receive but then enters an
    all-reduce with everyone: the all-reduce's wait must progress the receive (MPI semantics for a posted
    receive), or rank 1 could never join the all-reduce."""
    if P < 2:
        pytest.skip("needs two ranks")
    count = 2**17

    def run():
        got = np.zeros(count)
        work = comm.irecv(got, 1, tag=12) if RANK == 0 else None
        if RANK == 1:
            comm.send(np.arange(count, dtype=np.float64), 0, tag=12)
        total = comm.allreduce(np.ones(4), algorithm="ring")
        if work is not None:
            work.wait()
        return got, total

    everyone = run_gathered(run)
    assert (everyone[0][0] == np.arange(count)).all()
    assert all((t == P).all() for _, t in everyone)


@pytest.mark.parametrize("count", [3, 2**16 + 3])
def test_mismatch_leaves_nothing_in_flight(count):
    """A receive of the wrong size raises ValueError naming both sizes; the sender completes; the next message on
    the same tag arrives intact (the mismatched payload was taken, not left to be matched later)."""
    if P < 2:
        pytest.skip("needs a sender")
    c = Communicator(WORLD, timeout=20.0)

    def run():
        if RANK == 1:
            c.send(np.full(count + 1, 3.0), 0, tag=6)
            c.send(np.full(count, 4.0), 0, tag=6)
        if RANK != 0:
            return None
        with pytest.raises(ValueError) as info:
            c.recv(np.zeros(count), 1, tag=6)
        after = c.recv(np.zeros(count), 1, tag=6)
        return str(info.value), after

    try:
        message, after = run_gathered(run)[0]
    finally:
        c.free()
    assert f"the sender sent {count + 1} elements of float64" in message and f"recv of {count} elements" in message
    assert (after == 4.0).all()


@pytest.mark.parametrize("count", [3, 2**16 + 3])
def test_receives_after_a_waiting_wildcard_one(pair, count):
    """A receive from ANY_SOURCE is probed for, not posted (MPICH over UCX loses messages a posted one matches
    between nodes: tests/cluster). Receives after it wait behind it only for messages it could take: rank 0 posts
    ANY_SOURCE under tag 5, then receives from rank 1 under tag 7 (which must complete, since rank 1 sends tag
    5 only after hearing from rank 0), then posts one from rank 1 under ANY_TAG, which must leave the tag-5
    message to the wildcard receive and take the tag-6 one sent after it."""
    c = pair

    def run():
        if RANK == 1:
            c.send(np.full(count, 7.0), 0, tag=7)
            c.recv(np.zeros(1), 0, tag=9)
            c.send(np.full(count, 5.0), 0, tag=5)
            c.send(np.full(count, 6.0), 0, tag=6)
        if RANK != 0:
            return None
        wildcard, any_tag = np.zeros(count), np.zeros(count)
        waiting = c.irecv(wildcard, ANY_SOURCE, tag=5)
        seven = c.recv(np.zeros(count), 1, tag=7)
        c.send(np.zeros(1), 1, tag=9)
        later = c.irecv(any_tag, 1, tag=ANY_TAG)
        later.wait()
        waiting.wait()
        return seven, wildcard, any_tag, (waiting.source, waiting.tag), (later.source, later.tag)

    seven, wildcard, any_tag, matched, later = run_gathered(run)[0]
    assert (seven == 7.0).all() and (wildcard == 5.0).all() and (any_tag == 6.0).all()
    assert matched == (1, 5) and later == (1, 6)


def test_any_source_receive_times_out_and_the_channel_keeps_working():
    c = Communicator(WORLD, timeout=1.0)

    def run():
        with pytest.raises(CommTimeoutError, match="from any rank") as info:
            c.recv(np.zeros(3), ANY_SOURCE, tag=77)
        assert "keeps working" in str(info.value)
        partner = (RANK + 1) % P
        got = c.sendrecv(np.full(3, float(RANK)), partner, np.zeros(3), (RANK - 1) % P, tag=78)
        return got

    try:
        for r, got in enumerate(run_gathered(run)):
            assert (got == (r - 1) % P).all()
    finally:
        c.free()


def test_wildcards_are_only_for_receives(comm):
    with pytest.raises(ValueError, match="ANY_SOURCE"):
        comm.isend(np.ones(2), mpcomm.ANY_SOURCE)
    with pytest.raises(ValueError, match="ANY_TAG"):
        comm.isend(np.ones(2), 0, tag=mpcomm.ANY_TAG)
