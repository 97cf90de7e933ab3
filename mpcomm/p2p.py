"""Point-to-point messages with an envelope, so that a size or dtype mismatch raises instead of truncating and
a receive from any source learns who sent the message.

Every message begins with an envelope under the user's tag on the envelope channel: four integers (dtype
code, byte count, element count, sequence number) followed, for up to ``INLINE_BYTES`` of payload, by the
payload itself, so a small message is one MPI message. A larger payload follows on the payload channel (a
communicator of its own) under the sequence number as tag, which the sender counts per destination. The
receiver posts the payload receive once the envelope has named the source and the size: so a receive from
``ANY_SOURCE`` takes the payload that belongs to its envelope, receives for the same source and tag can never
take each other's payloads, and a mismatch is known before any payload lands in the user's buffer (the payload
is then received into a scratch buffer, so the sender completes and nothing stale is left in flight).

A receive from ``ANY_SOURCE`` is not posted to MPI: progress probes for its envelope (``MPI_Improbe``) and receives
the message it found (``MPI_Mrecv``), since MPICH over UCX loses messages that a posted ``ANY_SOURCE`` receive
matches between nodes (docs/mpi.md). Receives posted while it waits are probed for too, in the order posted, so
that each still takes the message MPI would give it.
"""
from __future__ import annotations

import functools
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Callable, cast

import numpy as np
from mpi4py import MPI

from .buffers import SUPPORTED_DTYPES, as_input, as_output, check_plain
from .errors import CommTimeoutError, MpcommError
from .transport import Transport, _error_text, cancel
from .work import Work, wait_timeout

INLINE_BYTES = 4096
ON_TIMEOUT = "the message was cancelled (point-to-point on this communicator keeps working)"
_HEADER = struct.Struct("<4q")  # dtype code, bytes, elements, sequence number (_INLINE: the payload follows)
_INLINE = -1
_MEMORYVIEW_KINDS = "biufc"  # numpy kinds whose buffer formats memoryview can cast (its copy is the cheapest)
_ENVELOPE_BYTES = _HEADER.size + INLINE_BYTES
_TAG_UB = cast(int, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))  # (every MPI library sets it)
_CODES = {np.dtype(d): zlib.crc32(np.dtype(d).name.encode()) for d in SUPPORTED_DTYPES}
_DTYPE_NAMES = {code: np.dtype(d).name for d, code in _CODES.items()}


class Wildcard:
    """``ANY_SOURCE`` / ``ANY_TAG``: distinct objects, so that a negative number is an error, not a wildcard."""

    __slots__ = ("name", "mpi")

    def __init__(self, name: str, mpi_value: int):
        self.name, self.mpi = name, mpi_value

    def __repr__(self) -> str:
        return f"mpcomm.{self.name}"


ANY_SOURCE = Wildcard("ANY_SOURCE", MPI.ANY_SOURCE)
ANY_TAG = Wildcard("ANY_TAG", MPI.ANY_TAG)


@dataclass
class Status:
    """What a receive matched: the sender's rank, the tag and the number of elements (``recv(status=...)``)."""

    source: int = -1
    tag: int = -1
    count: int = 0


class Channels:
    """The two communicators of point-to-point traffic, the per-destination sequence numbers, and the receives
    whose envelope has not been opened yet.

    A large payload's receive is posted only once its envelope is opened, and its sender may be waiting for
    exactly that (a rendezvous send completes when the receive is posted). So every wait of this rank —
    point-to-point, and the collectives' polls through ``Transport.progress_hook`` — calls :meth:`progress`,
    which opens every envelope that has arrived: no sender waits on a receive that was posted but not opened.
    """

    def __init__(self, envelopes: Transport, payloads: Transport):
        self.envelopes, self.payloads = envelopes, payloads
        self.rank, self.size = envelopes.rank, envelopes.size
        self._sequence = [0] * envelopes.size
        self._unopened: list[RecvWork] = []
        # their envelope requests, in the same order (for one Testsome); REQUEST_NULL for those still probed
        self._requests: list[MPI.Request] = []
        self.probing = 0  # how many of them are probed for (a receive from ANY_SOURCE, and those after it)
        self._lock = threading.Lock()  # guards both; opening runs under it, so one thread opens a receive
        # told of a wait's CommTimeoutError before it is raised (the Communicator's flight-recorder dump)
        self.timed_out: Callable[[CommTimeoutError], object] | None = None
        envelopes.progress_hook = payloads.progress_hook = self.progress

    def next_sequence(self, dst: int) -> int:
        number = self._sequence[dst]
        self._sequence[dst] = number + 1 if number < _TAG_UB else 0
        return number

    def register(self, work: "RecvWork") -> None:
        """Post ``work``'s envelope receive, or probe for it (from ANY_SOURCE, or behind a receive probed for),
        and open it in :meth:`progress`."""
        with self._lock:
            if work._src == MPI.ANY_SOURCE or self.probing:
                self.probing += 1
                self._requests.append(MPI.REQUEST_NULL)
            else:
                work._request = self.envelopes.mpi.Irecv(work._envelope, work._src, work._tag)
                self._requests.append(work._request)
            self._unopened.append(work)

    def progress(self) -> None:
        """Open the receives whose envelopes have arrived (another thread doing it already is enough).

        Every wait calls this on every poll, so it asks MPI once (``Testsome``) however many receives are posted,
        not once per receive (bench/results/observations.md, "One Testsome for all posted receives"); a receive
        probed for is received once its probe finds a message, in the order the receives were posted.
        """
        if not self._unopened or not self._lock.acquire(False):
            return
        try:
            if self.probing:
                self._probe()
            statuses: list[MPI.Status] = []
            try:
                arrived = MPI.Request.Testsome(self._requests, statuses)
            except MPI.Exception:  # some receive failed: each one finds out its own error
                self._unopened[:] = [work for work in self._unopened if work._request is None or not work._try_open()]
            else:
                if not arrived:
                    return
                for index, status in zip(arrived, statuses):
                    self._unopened[index]._accept(status)
                opened = set(arrived)
                self._unopened[:] = [work for i, work in enumerate(self._unopened) if i not in opened]
            self._requests[:] = self._posted()
        finally:
            self._lock.release()

    def _probe(self) -> None:
        """Receive the envelopes that the probed-for receives find, in the order they were posted (under the
        lock): each becomes a posted receive of the message its probe matched, which Testsome then completes. A
        message that an earlier receive still waiting could match (it may arrive between their probes) is left to
        it, as MPI gives a message to the earliest receive that matches it."""
        mpi = self.envelopes.mpi
        failed: list[RecvWork] = []
        waiting: list[RecvWork] = []  # probed for in this pass, no message yet
        status = MPI.Status()
        for i, work in enumerate(self._unopened):
            if work._request is not None:
                continue
            try:
                found = mpi.Iprobe(work._src, work._tag, status)
                source, tag = status.Get_source(), status.Get_tag()
                if not found or any(_matches(earlier, source, tag) for earlier in waiting):
                    waiting.append(work)
                    continue
                message = mpi.Improbe(source, tag)  # (the message Iprobe saw: the first from source with tag)
                if message is None:  # (taken meanwhile by a receive posted to MPI, from another thread)
                    waiting.append(work)
                    continue
            except MPI.Exception as exc:
                work._error, work._opened = _failure(self, work._describe(), exc), True
                failed.append(work)
            else:
                work._request = self._requests[i] = message.Irecv(work._envelope)
            self.probing -= 1
        if failed:
            self._unopened[:] = [work for work in self._unopened if work not in failed]
            self._requests[:] = self._posted()

    def _posted(self) -> list[MPI.Request]:
        """The envelope requests of the unopened receives, in their order (REQUEST_NULL where still probed)."""
        return [MPI.REQUEST_NULL if work._request is None else work._request for work in self._unopened]

    def forget(self, work: "RecvWork") -> None:
        with self._lock:
            if work in self._unopened:
                self._unopened.remove(work)
                if work._request is None:
                    self.probing -= 1
                self._requests[:] = self._posted()

    def free(self) -> None:
        self.envelopes.free()
        self.payloads.free()


# ---------------------------------------------------------------------------------------------- checks
def check_peer(size: int, peer, role: str, operation: str, wildcard: bool = False) -> int:
    """The MPI rank for ``peer``; ValueError for anything but an int in range (or ``ANY_SOURCE`` if allowed)."""
    if type(peer) is int and 0 <= peer < size:  # the common case first
        return peer
    if peer is ANY_SOURCE and wildcard:
        return MPI.ANY_SOURCE
    if type(peer) is not int and not isinstance(peer, np.integer) or not 0 <= peer < size:
        hint = " or mpcomm.ANY_SOURCE" if wildcard else ""
        raise ValueError(f"{operation}: {role} rank {peer!r} is not a rank of a communicator of size {size}"
                         f" (an int in 0..{size - 1}{hint})")
    return int(peer)


def check_tag(tag, operation: str, wildcard: bool = False) -> int:
    """The MPI tag for ``tag``; ValueError for anything but an int in 0..TAG_UB (or ``ANY_TAG`` if allowed)."""
    if type(tag) is int and 0 <= tag <= _TAG_UB:
        return tag
    if tag is ANY_TAG and wildcard:
        return MPI.ANY_TAG
    if type(tag) is not int and not isinstance(tag, np.integer) or not 0 <= tag <= _TAG_UB:
        hint = "; pass mpcomm.ANY_TAG to match any tag" if wildcard else ""
        raise ValueError(f"{operation}: tag {tag!r} is not an int in 0..{_TAG_UB} (the MPI library's TAG_UB){hint}")
    return int(tag)


# ---------------------------------------------------------------------------------------------- sending
def send(channels: Channels, buf, dst, tag, payload_transport) -> None:
    """``isend(...).wait()``; a small host message that MPI takes at once completes here without a Work.

    ``payload_transport(channels, "send", buf)`` gives the payload channel's transport (only for large messages).
    """
    if type(buf) is np.ndarray and buf.nbytes <= INLINE_BYTES and buf.flags.c_contiguous:
        if not (type(dst) is int and 0 <= dst < channels.size):
            dst = check_peer(channels.size, dst, "destination", "send")
        if not (type(tag) is int and 0 <= tag <= _TAG_UB):
            tag = check_tag(tag, "send")
        header = (_CODES.get(buf.dtype) or _code(buf.dtype, "send"), buf.nbytes, buf.size, _INLINE)
        request = channels.envelopes.mpi.Isend(_HEADER.pack(*header) + buf.tobytes(), dst, tag)
        if not request.Test():
            SendWork(channels, [request], header, dst, tag).wait()
        return
    isend(channels, payload_transport(channels, "send", buf), buf, dst, tag).wait()


def isend(channels: Channels, payload_t, buf, dst, tag=0) -> "SendWork":
    """Start sending ``buf`` to ``dst``; the buffer must not change until the Work completes.

    ``payload_t`` is the payload channel's transport for ``buf`` (a device wrapper for CuPy arrays).
    """
    dst = check_peer(channels.size, dst, "destination", "send")
    tag = check_tag(tag, "send")
    array = buf if type(buf) is np.ndarray else as_input(buf, "send")
    if not array.flags.c_contiguous:
        array = array.copy()
    code, nbytes, mpi = _code(array.dtype, "send"), array.nbytes, channels.envelopes.mpi
    if nbytes <= INLINE_BYTES and type(array) is np.ndarray:
        header = (code, nbytes, array.size, _INLINE)
        envelope = _HEADER.pack(*header) + array.tobytes()
        return SendWork(channels, [mpi.Isend(envelope, dst, tag)], header, dst, tag)
    sequence = channels.next_sequence(dst)
    header = (code, nbytes, array.size, sequence)
    requests = [mpi.Isend(_HEADER.pack(*header), dst, tag), payload_t.isend(array.reshape(-1), dst, sequence)]
    return SendWork(channels, requests, header, dst, tag, payload_t, array)


def _reported(wait: Callable) -> Callable:
    """A Work's ``wait`` that tells its channels' ``timed_out`` hook of a timeout before raising it."""
    @functools.wraps(wait)
    def reporting(self, timeout: float | None = None):
        try:
            return wait(self, timeout)
        except CommTimeoutError as exc:
            if self._channels.timed_out is not None:
                self._channels.timed_out(exc)
            raise
    return reporting


class SendWork(Work):
    """A send in flight: done when MPI has taken the envelope (and payload)."""

    __slots__ = ("_channels", "_requests", "_header", "_dst", "_tag", "_payload_t", "_keep", "_done")

    def __init__(self, channels, requests, header, dst, tag, payload_t=None, keep=None):
        self._channels, self._requests, self._header = channels, requests, header
        self._dst, self._tag, self._payload_t, self._keep = dst, tag, payload_t, keep
        self._done = False

    @_reported
    def wait(self, timeout: float | None = None) -> None:
        if timeout is not None:
            timeout = wait_timeout(timeout, "send: wait")
        if not self._done:
            t, requests = self._payload_t, self._requests
            if t is None and len(requests) == 1 and requests[0].Test():  # a small message, already gone
                self._done = True
                return
            t = t or self._channels.envelopes  # (a device wrapper's wait releases its staged copy)
            if type(t) is not Transport or not MPI.Request.Testall(requests):
                t.wait(requests, (self._dst,) * len(requests), timeout=timeout, operation=_Lazy(self._describe))
            self._done, self._keep = True, None

    def _describe(self) -> str:
        return f"send of {_describe(self._header)} to rank {self._dst} (tag {self._tag})"

    def is_completed(self) -> bool:
        if not self._done:
            self._channels.progress()  # a peer may be waiting, as this send may, for this rank to open envelopes
            if all(r.Get_status() for r in self._requests):
                self.wait()
        return self._done


# ---------------------------------------------------------------------------------------------- receiving
def recv(channels: Channels, buf, src, tag, status: Status | None, payload_transport):
    """``irecv(...).wait()``; the receive is not registered for other waits to open (this thread opens it).

    The common case — a host array small enough to arrive inline, and an inline envelope of the same dtype and
    size — is done here without a Work: the envelope is polled (deadline and progress as every wait) and copied.
    ``payload_transport(channels, "recv", buf)`` gives the payload channel's transport (for any other case).
    """
    if type(buf) is not np.ndarray or buf.nbytes > INLINE_BYTES or channels.probing:
        return irecv(channels, payload_transport(channels, "recv", buf), buf, src, tag, status, register=False).wait()
    if not (type(src) is int and 0 <= src < channels.size):
        src = check_peer(channels.size, src, "source", "recv", wildcard=True)
    if not (type(tag) is int and 0 <= tag <= _TAG_UB):
        tag = check_tag(tag, "recv", wildcard=True)
    flags, dtype, nbytes = buf.flags, buf.dtype, buf.nbytes
    _check_writeable(buf, flags)
    code = _CODES.get(dtype) or _code(dtype, "recv")
    envelopes = channels.envelopes
    # A fresh envelope each time: a reused one was slower in some heap layouts (bench/results/observations.md).
    envelope = bytearray(_ENVELOPE_BYTES)
    try:
        request = envelopes.mpi.Irecv(envelope, src, tag) if src != MPI.ANY_SOURCE else \
            _probed_receive(envelopes, envelope, tag, _Lazy(lambda: _describe_recv(buf, src, tag)))
    except MPI.Exception as exc:
        raise _failure(channels, _describe_recv(buf, src, tag), exc) from None
    # Everything the arrival is checked against and copied with is made before it arrives (off the latency path).
    expected = _HEADER.pack(code, nbytes, buf.size, _INLINE)
    inline = memoryview(envelope)[_HEADER.size : _HEADER.size + nbytes]
    target = memoryview(buf).cast("B") if dtype.kind in _MEMORYVIEW_KINDS and flags.c_contiguous else None
    wildcard = src == MPI.ANY_SOURCE or tag == MPI.ANY_TAG
    matched = MPI.Status() if wildcard or status is not None else None
    try:
        arrived = request.Test() if matched is None else request.Test(matched)
    except MPI.Exception as exc:
        raise _failure(channels, _describe_recv(buf, src, tag), exc) from None
    if not arrived:
        peers = envelopes.others if src == MPI.ANY_SOURCE else (src,)
        envelopes.wait_one(request, peers, matched, _Lazy(lambda: _describe_recv(buf, src, tag)))
    if target is None or not envelope.startswith(expected):  # another size, dtype or layout: the general path
        if matched is None:
            matched = MPI.Status()
            matched.Set_source(src)
            matched.Set_tag(tag)
        work = RecvWork(channels, payload_transport(channels, "recv", buf), request,
                        np.frombuffer(envelope, np.uint8), buf, buf, src, tag, status)
        work._registered = False
        work._accept(matched)
        return work.wait()
    target[:] = inline
    if status is not None:
        assert matched is not None  # made where a status is asked for
        status.source, status.tag, status.count = matched.Get_source(), matched.Get_tag(), buf.size
    return buf


def _probed_receive(envelopes: Transport, envelope, tag: int, operation: _Lazy) -> MPI.Request:
    """The receive into ``envelope`` of the first message from any rank under ``tag``, found by ``MPI_Improbe``
    polled within the deadline (not a posted ANY_SOURCE receive: see the module docstring)."""
    found: list[MPI.Message] = []

    def probe() -> bool:
        message = envelopes.mpi.Improbe(MPI.ANY_SOURCE, tag)
        if message is not None:
            found.append(message)
        return message is not None

    envelopes.poll_until(probe, envelopes.others, operation)
    return found[0].Irecv(envelope)


def irecv(channels: Channels, payload_t, buf, src=ANY_SOURCE, tag=ANY_TAG, status: Status | None = None,
          register: bool = True):
    """Start receiving into ``buf``; on completion raises if the sender's size or dtype differ.

    ``src``/``tag`` may be ``ANY_SOURCE``/``ANY_TAG``; the Work's ``source``/``tag`` (and ``status``) tell what
    was matched. ``register=False`` only for a receive waited on at once by the calling thread (:func:`recv`);
    one that is probed for (:meth:`Channels.register`) is registered all the same, to be probed in its turn.
    """
    src = check_peer(channels.size, src, "source", "recv", wildcard=True)
    tag = check_tag(tag, "recv", wildcard=True)
    array = buf if type(buf) is np.ndarray else as_output(buf, "recv")
    _check_writeable(array)
    _code(array.dtype, "recv")
    envelope = np.empty(_ENVELOPE_BYTES, dtype=np.uint8)
    work = RecvWork(channels, payload_t, None, envelope, buf, array, src, tag, status)
    if register or src == MPI.ANY_SOURCE or channels.probing:
        channels.register(work)
    else:
        work._request, work._registered = channels.envelopes.mpi.Irecv(envelope, src, tag), False
    return work


class RecvWork(Work):
    """A receive in flight: the envelope first, then (for large messages) the payload it announces."""

    __slots__ = ("_channels", "_payload_t", "_request", "_envelope", "_buf", "_array", "_src", "_tag", "_status",
                 "_opened", "_registered", "_payload", "_target", "_done", "_error", "source", "tag")

    def __init__(self, channels, payload_t, request, envelope, buf, array, src, tag, status):
        self._channels, self._payload_t, self._request, self._envelope = channels, payload_t, request, envelope
        self._buf, self._array, self._src, self._tag, self._status = buf, array, src, tag, status
        self._opened, self._registered = False, True
        self._payload: MPI.Request | None = None
        self._target = None
        self._done = False
        self._error: Exception | None = None
        self.source: int | None = None
        self.tag: int | None = None

    @_reported
    def wait(self, timeout: float | None = None):
        if timeout is not None:
            timeout = wait_timeout(timeout, "recv: wait")
        if not self._done and self._error is None:
            limit = self._channels.envelopes.timeout if timeout is None else timeout
            start = time.monotonic()
            if not self._opened and (self._registered or not self._try_open()):
                self._wait_opened(start, limit)
            if self._payload is not None and self._error is None:
                peers = (self.source,)
                remaining = max(0.0, limit - (time.monotonic() - start))
                self._payload_t.wait([self._payload], peers, timeout=remaining, operation=_Lazy(self._describe))
                self._finish()
        if self._error is not None:
            raise self._error
        return self._buf

    def is_completed(self) -> bool:
        if not self._opened:
            self._channels.progress()
            if not self._opened:
                return False
        if self._payload is not None and not self._done and self._error is None and not self._payload.Get_status():
            return False
        self.wait()
        return True

    def _wait_opened(self, start: float, limit: float) -> None:
        """Until this receive's envelope is opened (by this thread or another's progress), within ``limit`` s."""
        channels, spins = self._channels, 0
        own = not self._registered  # nobody else opens this one
        if own:
            self._try_open()
        channels.progress()
        while not self._opened:
            spins += 1
            if own:
                self._try_open()
            if spins < channels.envelopes.spins_before_yield:
                channels.progress()
                continue
            spins = 0
            os.sched_yield()
            elapsed = time.monotonic() - start
            if elapsed > limit:
                channels.forget(self)
                if not self._opened:  # not opened meanwhile: give up on it (one probed for has nothing posted)
                    if self._request is not None:
                        cancel(self._request)
                    peers = channels.envelopes.others if self._src == MPI.ANY_SOURCE else (self._src,)
                    channels.envelopes.failed = True
                    raise CommTimeoutError(self._describe(), peers, elapsed, limit, channels.rank, ON_TIMEOUT)
            channels.progress()

    def _try_open(self) -> bool:
        """Open the envelope if it has arrived (called under the channels' lock); True once opened."""
        status = MPI.Status()
        try:
            if not self._request.Test(status):
                return False
        except MPI.Exception as exc:
            self._error = _failure(self._channels, self._describe(), exc)
            self._opened = True
            return True
        self._accept(status)
        return True

    def _accept(self, status: MPI.Status) -> None:
        """The envelope arrived with ``status``: open it, keeping a mismatch for wait() to raise."""
        try:
            self._open(status)
        except ValueError as exc:  # kept for wait()
            self._error = exc
        self._opened = True

    def _open(self, status: MPI.Status) -> None:
        """The envelope has arrived: check it, then copy an inline payload or post the payload's receive."""
        self.source, self.tag = status.Get_source(), status.Get_tag()
        sent = _HEADER.unpack_from(self._envelope)
        code, nbytes, count, sequence = sent
        array = self._array
        if code != _code(array.dtype) or nbytes != array.nbytes:
            if sequence != _INLINE:  # take the payload anyway: the sender completes, nothing is left in flight
                drain = np.empty(nbytes, dtype=np.uint8)
                self._channels.payloads.wait([self._channels.payloads.mpi.Irecv(drain, self.source, sequence)],
                                             (self.source,), operation=_Lazy(self._describe))
            raise ValueError(f"{self._describe()}: the sender sent {_describe(sent, array.dtype)} (rank {self.source}, "
                             f"tag {self.tag}); sizes and dtypes must match exactly (the message was taken and "
                             "dropped, as MPI drops a truncated one)")
        self._target = array if array.flags.c_contiguous else array.copy()
        if sequence == _INLINE:
            if nbytes:
                inline = self._envelope[_HEADER.size : _HEADER.size + nbytes]
                target = self._target
                if type(target) is not np.ndarray:
                    target.reshape(-1).view(np.uint8)[...] = _to_device(inline)
                else:
                    _copy_inline(target, memoryview(inline))
            self._finish()
            return
        self._payload = self._payload_t.irecv(self._target.reshape(-1), self.source, sequence)

    def _finish(self) -> None:
        if self._target is not self._array:
            self._array[...] = self._target
        if self._status is not None:
            self._status.source, self._status.tag, self._status.count = self.source, self.tag, self._array.size
        self._done = True

    def _describe(self) -> str:
        return _describe_recv(self._array, self._src, self._tag)


# ---------------------------------------------------------------------------------------------- helpers
def _matches(work: RecvWork, source: int, tag: int) -> bool:
    """Whether a message from ``source`` with ``tag`` matches ``work``'s receive."""
    return work._src in (source, MPI.ANY_SOURCE) and work._tag in (tag, MPI.ANY_TAG)


class _Lazy:
    """A label formatted only when an error message needs it (the hot path never formats)."""

    __slots__ = ("describe",)

    def __init__(self, describe):
        self.describe = describe

    def __str__(self) -> str:
        return self.describe()


def _failure(channels: Channels, what: str, exc: MPI.Exception) -> MpcommError:
    """mpcomm's error for an MPI failure of a receive (never a bare MPI.Exception)."""
    return MpcommError(f"rank {channels.rank}: {what}: {_error_text(exc.Get_error_code())}")


def _check_writeable(array, flags=None) -> None:
    if not (flags or array.flags).writeable:
        raise ValueError(f"recv: output buffer is read-only (shape {array.shape}, dtype {array.dtype})")


def _copy_inline(target: np.ndarray, inline: memoryview) -> None:
    """Copy an inline payload into a contiguous host array of exactly its size."""
    if target.dtype.kind in _MEMORYVIEW_KINDS:
        memoryview(target).cast("B")[:] = inline
    else:
        target.reshape(-1).view(np.uint8)[...] = inline


def _describe_recv(array, src: int, tag: int) -> str:
    source = "any rank" if src == MPI.ANY_SOURCE else f"rank {src}"
    tags = "any tag" if tag == MPI.ANY_TAG else f"tag {tag}"
    return f"recv of {array.size} elements of {array.dtype} ({array.nbytes} B) from {source} ({tags})"


def _code(dtype: np.dtype, operation: str = "recv") -> int:
    """The envelope's code of ``dtype``; TypeError (before any communication) for dtypes of Python objects."""
    code = _CODES.get(dtype)
    if code is not None:
        return code
    check_plain(dtype, operation)
    return zlib.crc32(dtype.name.encode())


def _to_device(host_bytes):
    import cupy

    return cupy.asarray(host_bytes)


def _describe(header, receiving: np.dtype | None = None) -> str:
    """A header's payload in words; ``receiving``: the receiver's dtype, which names a code of its own."""
    code, nbytes, count = (int(x) for x in header[:3])
    name = _DTYPE_NAMES.get(code)
    if name is None:
        name = (str(receiving) if receiving is not None and code == _code(receiving)
                else "a dtype other than mpcomm's numeric ones (a structured, string or other non-numeric dtype)")
    return f"{count} elements of {name} ({nbytes} B)"
