"""Point-to-point messages with a small header, so a size or dtype mismatch raises instead of truncating.

Every message is two MPI messages on the same (communicator, tag): a 3-integer header (dtype code, byte
count, element count) and the payload. MPI's non-overtaking rule keeps them paired; the receiver posts
both at once, so a header costs no extra round trip.
"""
from __future__ import annotations

import zlib

import numpy as np

from .buffers import SUPPORTED_DTYPES, as_input, as_output, flat
from .errors import MpcommError
from .transport import Transport
from .work import RequestWork

_CODES = {np.dtype(d): zlib.crc32(np.dtype(d).name.encode()) for d in SUPPORTED_DTYPES}
_DTYPE_NAMES = {code: np.dtype(d).name for d, code in _CODES.items()}


def _header(array) -> np.ndarray:
    dtype = array.dtype
    code = _CODES.get(dtype)
    if code is None:
        code = zlib.crc32(dtype.name.encode())
    return np.array([code, array.nbytes, array.size], dtype=np.int64)


def _describe(header: np.ndarray) -> str:
    code, nbytes, count = (int(x) for x in header)
    return f"{count} elements of {_DTYPE_NAMES.get(code, 'dtype#%d' % code)} ({nbytes} B)"


class _Operation:
    """``"send of 10 elements of float64 (80 B) to rank 1 (tag 0)"``, formatted only when an error needs it."""

    __slots__ = ("verb", "header", "where", "peer", "tag")

    def __init__(self, verb: str, header: np.ndarray, where: str, peer: int, tag: int):
        self.verb, self.header, self.where, self.peer, self.tag = verb, header, where, peer, tag

    def __str__(self) -> str:
        return f"{self.verb} of {_describe(self.header)} {self.where} rank {self.peer} (tag {self.tag})"


def check_peer(t: Transport, peer: int, role: str, operation: str) -> None:
    """ValueError for a rank outside the communicator."""
    if not isinstance(peer, (int, np.integer)) or not 0 <= int(peer) < t.size:
        raise ValueError(f"{operation}: {role} rank {peer!r} is out of range for a communicator of size {t.size}")


def isend(t: Transport, buf, dst: int, tag: int = 0) -> RequestWork:
    """Start sending ``buf`` to ``dst``; the buffer must not change until the Work completes."""
    check_peer(t, dst, "destination", "send")
    array = as_input(buf, "send")
    payload = flat(array)
    if payload is None:  # non-contiguous: send a contiguous copy
        payload = array.copy().reshape(-1)
    header = _header(payload)
    requests = [t.isend(header, dst, tag), t.isend(payload, dst, tag)]

    def complete(timeout):
        with t.running(_Operation("send", header, "to", dst, tag)):
            t.wait(requests, (dst, dst), timeout=timeout)
        payload.size  # keep the payload alive until the send completes

    return RequestWork(complete, lambda: _ready(requests))


def irecv(t: Transport, buf, src: int, tag: int = 0) -> RequestWork:
    """Start receiving into ``buf`` from ``src``; raises on completion if the sender's size or dtype differ."""
    check_peer(t, src, "source", "recv")
    array = as_output(buf, "recv")
    target = flat(array)
    payload = target if target is not None else array.copy().reshape(-1)
    header = np.zeros(3, dtype=np.int64)
    requests = [t.irecv(header, src, tag), t.irecv(payload, src, tag)]
    expected = _header(payload)

    def complete(timeout):
        operation = _Operation("recv", expected, "from", src, tag)
        with t.running(operation):
            try:
                t.wait(requests, (src, src), (expected.nbytes, None), timeout=timeout)
            except MpcommError as exc:
                if header.any():
                    raise _mismatch(operation, header) from None
                raise exc
        if not (header[0] == expected[0] and header[1] == expected[1] and header[2] == expected[2]):
            raise _mismatch(operation, header)
        if target is None:
            array[...] = payload.reshape(array.shape)
        return buf

    return RequestWork(complete, lambda: _ready(requests))


def _ready(requests) -> bool:
    """Whether every request has completed, without freeing them (unlike Testall), so the statuses that
    ``complete`` checks (byte counts) are still there when it runs."""
    return all(request.Get_status() for request in requests)


def _mismatch(operation: str, header: np.ndarray) -> ValueError:
    return ValueError(f"{operation}: the sender sent {_describe(header)}; sizes and dtypes must match exactly")
