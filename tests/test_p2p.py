"""Point-to-point: send/recv, isend/irecv + Work, sendrecv rings, strided buffers, many tagged messages, and
sender/receiver mismatches that must raise ValueError on the receiver (never truncate) while the sender
completes cleanly.

Works at any world size: exchanges are with a partner (rank ^ 1, or oneself when that does not exist), with
receives posted before sends so that messages to oneself work too.
Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_p2p.py``.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import BFLOAT16, WORLD, make_input, run_gathered

import mpcomm
from mpcomm import CommTimeoutError, Communicator

pytestmark = pytest.mark.mpi
P = WORLD.Get_size()
LARGE = 2**16 + 3  # above MPICH's eager limit: the rendezvous path


def partner_of(rank: int, size: int) -> int:
    """rank ^ 1, or the rank itself when that does not exist (odd world size)."""
    return rank ^ 1 if (rank ^ 1) < size else rank


def partner(comm: Communicator) -> int:
    return partner_of(comm.rank, comm.size)


def exchange(comm: Communicator, send, recv, tag: int = 0):
    """Send ``send`` to the partner and receive ``recv`` from it; returns (recv error, send error)."""
    peer = partner(comm)
    receiving = comm.irecv(recv, peer, tag)
    sending = comm.isend(send, peer, tag)
    errors = []
    for work in (receiving, sending):
        try:
            work.wait()
            errors.append(None)
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            errors.append(exc)
    return errors


def exchange_blocking(comm: Communicator, send, recv, tag: int = 0):
    """:func:`exchange` through the blocking ``send``/``recv`` (their own fast path for small host arrays): the
    even rank of a pair sends first, the odd one receives first; a rank that is its own partner posts an isend
    first."""
    peer, errors = partner(comm), [None, None]

    def receive():
        try:
            comm.recv(recv, peer, tag)
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            errors[0] = exc

    def send_it():
        try:
            comm.send(send, peer, tag)
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            errors[1] = exc

    if peer == comm.rank:
        work = comm.isend(send, peer, tag)
        receive()
        work.wait()
    elif comm.rank % 2 == 0:
        send_it()
        receive()
    else:
        receive()
        send_it()
    return errors


SWAPS = pytest.mark.parametrize("swap", [exchange, exchange_blocking], ids=["nonblocking", "blocking"])


def test_recv_into_a_read_only_buffer_is_a_value_error(comm):
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    for receive in (comm.recv, comm.irecv):
        with pytest.raises(ValueError, match="read-only"):
            receive(frozen, comm.rank, 5)


def test_blocking_send_recv(comm):
    """Even ranks send first then receive, odd ranks the reverse (no reliance on buffering)."""
    if comm.size < 2:
        pytest.skip("blocking send/recv between distinct ranks needs 2 ranks")

    def run():
        peer = partner(comm)
        data = make_input(np.float64, "sum", (1000,), comm.rank)
        got = np.empty_like(data)
        if peer == comm.rank:
            return None
        if comm.rank % 2 == 0:
            comm.send(data, peer, tag=3)
            returned = comm.recv(got, peer, tag=3)
        else:
            returned = comm.recv(got, peer, tag=3)
            comm.send(data, peer, tag=3)
        return data, got, returned is got

    everyone = run_gathered(run)
    for r, result in enumerate(everyone):
        if result is not None:
            assert result[2]
            assert np.array_equal(result[1], everyone[r ^ 1][0])


@SWAPS
@pytest.mark.parametrize("size", [0, 1, 7, LARGE])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16, np.int16, np.uint64, np.bool_, np.complex128], ids=str)
def test_isend_irecv_exchange(comm, dtype, size, swap):
    def run():
        data = make_input(dtype, "max", (size,), comm.rank, seed=size)
        got = np.zeros_like(data)
        return data, got, swap(comm, data, got)

    everyone = run_gathered(run)
    for r, (data, got, errors) in enumerate(everyone):
        assert errors == [None, None]
        sender = everyone[partner_of(r, len(everyone))][0]
        assert np.array_equal(got.view(np.uint8), sender.view(np.uint8))


def test_work_wait_and_is_completed(comm):
    """is_completed() is False while the message cannot have been sent, True once it has arrived."""
    if comm.size < 2:
        pytest.skip("needs a second rank to hold the message back")

    def run():
        if comm.rank == 0:
            got = np.zeros(16, dtype=np.int32)
            work = comm.irecv(got, 1, tag=9)
            before = work.is_completed()  # rank 1 sends only after the barrier below
            WORLD.Barrier()
            returned = work.wait(timeout=30.0)
            return before, work.is_completed(), returned is got, got
        if comm.rank == 1:
            WORLD.Barrier()
            work = comm.isend(np.arange(16, dtype=np.int32), 0, tag=9)
            work.wait(timeout=30.0)
            return work.is_completed()
        WORLD.Barrier()
        return None

    everyone = run_gathered(run)
    before, after, returned_buf, got = everyone[0]
    assert before is False and after is True and returned_buf
    assert np.array_equal(got, np.arange(16))
    assert everyone[1] is True


def test_is_completed_polls_to_completion(comm):
    """A receive can be completed by polling is_completed() alone (no wait call)."""

    def run():
        data = np.arange(5, dtype=np.float64) + comm.rank
        got = np.zeros(5)
        receiving = comm.irecv(got, partner(comm), tag=11)
        sending = comm.isend(data, partner(comm), tag=11)
        polls = 0
        while not (receiving.is_completed() and sending.is_completed()):
            polls += 1
            if polls > 10_000_000:
                raise RuntimeError("is_completed() never became True")
        return got

    everyone = run_gathered(run)
    for r, got in enumerate(everyone):
        assert np.array_equal(got, np.arange(5) + partner_of(r, len(everyone)))


def test_wait_timeout_raises_comm_timeout():
    """Work.wait(timeout) on a receive nobody sends: CommTimeoutError naming recv, the source and the time."""
    c = Communicator(WORLD, timeout=60.0)  # dedicated (the cancelled receive stays on it); a wait bounded by
    # the communicator's timeout instead of the wait's would take far too long

    def run():
        work = c.irecv(np.zeros(3), (c.rank + 1) % c.size, tag=77)
        start = time.monotonic()
        try:
            work.wait(timeout=0.3)
        except CommTimeoutError as exc:
            return str(exc), exc.elapsed, time.monotonic() - start
        return None

    everyone = run_gathered(run)
    for r, result in enumerate(everyone):
        assert result is not None, f"rank {r}: wait(timeout) returned without a message"
        message, elapsed, wall = result
        assert "recv" in message and f"rank {(r + 1) % len(everyone)}" in message and "timed out after" in message
        assert elapsed >= 0.3 and wall < 0.3 + 5.0, f"rank {r}: gave up after {wall:.1f} s (timeout 0.3 s)"


def test_sendrecv_ring(comm):
    """Each rank sends right and receives from the left, in both directions; works at size 1 (to itself)."""

    def run():
        p, r = comm.size, comm.rank
        data = make_input(np.float32, "sum", (33,), r)
        right, left = np.zeros_like(data), np.zeros_like(data)
        returned = comm.sendrecv(data, (r + 1) % p, right, (r - 1) % p, tag=5)
        comm.sendrecv(data, (r - 1) % p, left, (r + 1) % p, tag=6)
        return data, right, left, returned is right

    everyone = run_gathered(run)
    p = len(everyone)
    for r, (_, from_left, from_right, returned_buf) in enumerate(everyone):
        assert returned_buf
        assert np.array_equal(from_left, everyone[(r - 1) % p][0])
        assert np.array_equal(from_right, everyone[(r + 1) % p][0])


@SWAPS
def test_noncontiguous_send_and_recv(comm, swap):
    def run():
        base = make_input(np.int64, "sum", (10, 6), comm.rank)
        out = np.full((6, 10), -1, dtype=np.int64)
        errors = swap(comm, base[::2, 1::2], out[::2, ::2].T)  # strided send, strided (transposed) receive
        return base, out, errors

    everyone = run_gathered(run)
    for r, (_, out, errors) in enumerate(everyone):
        assert errors == [None, None]
        sender = everyone[partner_of(r, len(everyone))][0]
        expected = np.full((6, 10), -1, dtype=np.int64)
        expected[::2, ::2] = sender[::2, 1::2].T
        assert np.array_equal(out, expected)


def test_many_outstanding_messages_distinct_tags(comm):
    """64 messages in flight at once; receives posted in reverse tag order still match by tag."""
    count = 64

    def run():
        peer = partner(comm)
        got = [np.zeros(7, dtype=np.int32) for _ in range(count)]
        receives = [comm.irecv(got[tag], peer, tag=tag) for tag in reversed(range(count))]
        payloads = [np.full(7, 1000 * comm.rank + tag, dtype=np.int32) for tag in range(count)]
        sends = [comm.isend(payloads[tag], peer, tag=tag) for tag in range(count)]
        for work in sends + receives:
            work.wait()
        return got

    everyone = run_gathered(run)
    for r, got in enumerate(everyone):
        peer = partner_of(r, len(everyone))
        for tag in range(count):
            assert (got[tag] == 1000 * peer + tag).all(), f"rank {r} tag {tag}: {got[tag]}"


MISMATCHES = {
    "larger": (np.zeros(10, np.float64), np.zeros(5, np.float64)),
    "smaller": (np.zeros(5, np.float64), np.zeros(10, np.float64)),
    "dtype-same-bytes": (np.zeros(6, np.float32), np.zeros(6, np.int32)),
    "dtype-same-count": (np.zeros(6, np.float32), np.zeros(6, np.float64)),
    "larger-rendezvous": (np.zeros(LARGE, np.float64), np.zeros(LARGE - 1, np.float64)),
    "smaller-rendezvous": (np.zeros(LARGE - 1, np.float64), np.zeros(LARGE, np.float64)),
}


@SWAPS
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatch_raises_on_receiver_and_sender_completes(comm, case, swap):
    """The receiver gets ValueError saying what was sent (never a silently truncated or half-filled buffer), the
    sender's wait returns normally, and the communicator keeps working afterwards. (What the failed receive
    leaves in its buffer: test_mismatched_receive_leaves_the_buffer_untouched.)"""
    send_template, recv_template = MISMATCHES[case]

    def run():
        send = send_template + 1
        recv = np.full_like(recv_template, 7)
        receive_error, send_error = swap(comm, send, recv, tag=21)
        # the same communicator still works: a matching exchange right after
        ok = np.zeros(3)
        follow_up = exchange(comm, np.full(3, comm.rank, dtype=np.float64), ok, tag=21)
        return (None if receive_error is None else (type(receive_error).__name__, str(receive_error)),
                send_error, follow_up, ok)

    everyone = run_gathered(run)
    for r, (receive_error, send_error, follow_up, ok) in enumerate(everyone):
        assert receive_error is not None and receive_error[0] == "ValueError", f"rank {r}: {receive_error}"
        assert "recv" in receive_error[1] and "sender sent" in receive_error[1]
        assert send_error is None, f"rank {r}: sender failed: {send_error}"
        assert follow_up == [None, None]
        assert (ok == partner_of(r, len(everyone))).all()


@SWAPS
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_receive_leaves_the_buffer_untouched(comm, case, swap):
    """A receive that raises because the sender's size or dtype differ leaves the buffer as it was: no half of a
    message, no bytes of another dtype."""
    send_template, recv_template = MISMATCHES[case]

    def run():
        recv = np.full_like(recv_template, 7)
        receive_error, _ = swap(comm, send_template + 1, recv, tag=22)
        return receive_error is not None, int(np.count_nonzero(recv != 7)), recv.size

    everyone = run_gathered(run)
    for r, (raised, changed, size) in enumerate(everyone):
        assert raised, f"rank {r}: the mismatched receive did not raise"
        assert changed == 0, f"rank {r}: the failed receive overwrote {changed} of the {size} elements of its buffer"


BAD_P2P = {  # name -> (call on comm c, words)
    "send-negative-tag": (lambda c: c.send(np.ones(2), 0, tag=-1), "tag -1"),
    "send-huge-tag": (lambda c: c.send(np.ones(2), 0, tag=2**31), "tag 2147483648"),
    "send-fractional-tag": (lambda c: c.isend(np.ones(2), 0, tag=1.5), "tag 1.5"),
    "recv-minus-one-tag": (lambda c: c.irecv(np.ones(2), 0, tag=-1), "mpcomm.ANY_TAG"),
    "recv-bool-source": (lambda c: c.irecv(np.ones(2), True), "True"),
    "send-to-any-source": (lambda c: c.isend(np.ones(2), mpcomm.ANY_SOURCE), "ANY_SOURCE"),
    "broadcast-root-true": (lambda c: c.broadcast(np.ones(2), root=True), "root True"),
    "reduce-root-true": (lambda c: c.reduce(np.ones(2), np.ones(2), root=True), "root True"),
    "gather-root-true": (lambda c: c.gather(np.ones(2), np.ones(2 * P), root=True), "root True"),
    "scatter-root-true": (lambda c: c.scatter(np.ones(2 * P), np.ones(2), root=np.True_), f"root {np.True_!r}"),
    "broadcast-root-float": (lambda c: c.broadcast(np.ones(2), root=0.0), "root 0.0"),
}


@pytest.mark.parametrize("case", list(BAD_P2P))
def test_bad_tags_and_ranks_are_value_errors(comm, case):
    """(A bad root makes the Communicator unusable on that rank, see tests/test_edges.py: a fresh one for those.)"""
    call, words = BAD_P2P[case]
    c = Communicator(WORLD, timeout=10.0) if "root" in case else comm
    try:
        with pytest.raises(ValueError) as info:
            call(c)
    finally:
        if c is not comm:
            c.free()
    assert words in str(info.value), info.value
