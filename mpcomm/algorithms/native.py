"""The MPI library's own collectives, issued non-blocking so the wait is bounded by the timeout (the all-reduce,
where a watchdog can revoke the communicator at the deadline, as the blocking call: :func:`watch`).

Two things the MPI library does not promise are restored here, so that ``native`` meets the same contract as
mpcomm's own algorithms:

* min/max of floats: MPI's MIN/MAX do not propagate NaN, and which of -0.0/+0.0 they return depends on the
  operand order, which differs between ranks. They are reduced with mpcomm's own min/max as MPI ops
  (``mpcomm.native_calls``: NaN wins, -0.0 below +0.0), or where those are missing as integer keys that sort like
  the floats (NaN mapped to the extreme that wins; ``mpcomm.kernels``, one pass each way).
* sums and products of floats with NaN: the NaN's sign and payload depend on the operand order, which differs
  between ranks in the library's recursive doubling; an all-reduce that produced NaN writes numpy's NaN (inside
  the library's reduction with mpcomm's sum and product ops, up to the size ``mpcomm.mpi_library`` says they pay;
  else in a pass after it).
"""
from __future__ import annotations

import functools
import zlib
from array import array
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from ..buffers import AVG, MAX, MIN, PROD, SUM, ReduceOp
from ..errors import CollectiveMismatchError, CommTimeoutError
from ..kernels import KEY_DTYPES, finish_floats, from_keys, to_keys
from ..mpi_library import Library, copies_input, library
from ..native_calls import fault_tolerant
from ..native_calls import load as load_calls
from ..native_calls import reduction_ops
from ..transport import Transport

_MIN_MAX = (MIN, MAX)
_SMALL = 16  # up to this many elements a NaN is looked for by a sum in Python (see _has_nan)
_REAL = {np.dtype(np.complex64): np.dtype(np.float32), np.dtype(np.complex128): np.dtype(np.float64)}
# What native reduces with mpcomm's own ops (avg: its sum; not complex avg, whose division makes NaNs of its own,
# nor complex prod, whose NaNs and infinities are C's)
_OP_DTYPES = {MIN: frozenset(KEY_DTYPES), MAX: frozenset(KEY_DTYPES), SUM: frozenset([*KEY_DTYPES, *_REAL]),
              AVG: frozenset(KEY_DTYPES), PROD: frozenset(KEY_DTYPES)}
_PERSISTENT_KEPT = 64  # persistent all-reduces (of distinct count, dtype, op) one transport keeps at most
_ONE_CALL_UPTO = 64 << 10  # up to this many bytes native_calls does the all-reduce, holding the GIL throughout
C_TESTS = 4  # native_calls' Tests per quick Test of the transport's (transport.py): one costs a quarter of mpi4py's
# With a core each, 16 times as many: a rank whose call falls back to Python's wait reaches the next call late, so
# its partner's falls back too; on Open MPI a quarter of two ranks' exchanges of 8 B did, each call then 2-3x as
# long, where 512 Tests let almost none (bench/results/openmpi.md, "Stop 62"). Ranks sharing cores keep few.
C_TESTS_OWN_CORE = 64
# The meeting's Tests in native_calls before the deadline's wait, the GIL released: only ranks with a core each meet,
# and the blocking call after it spins as long
_MEETING_TESTS = 1000
# The dtypes native_calls' all-reduce takes (its datatype_of, in this machine's byte order)
_C_DTYPES = frozenset(np.dtype(name) for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64",
                                                  "uint64", "float32", "float64", "complex64", "complex128"))
# native's ways to wait (_way)
_PERSISTENT, _MEET, _FROM_COPY, _ONE_CALL, _MPI4PY = "persistent", "meet", "from a copy", "one call", "mpi4py"
_WATCHED = "blocking, watched"


def c_tests(t: Transport) -> int:
    """How many Tests native_calls makes of a call on ``t`` before it hands the request back to Python's wait."""
    return t.quick_tests * (C_TESTS if t.cores_shared else C_TESTS_OWN_CORE)


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    how = _how(t, buf, op)
    if how is None:
        keys = to_keys(buf, op.name)
        _allreduce_in_place(t, keys, op)
        from_keys(keys)
        return
    mpi_op, finish, nan_pass = how
    if not _allreduce_in_place(t, buf, op, finish, mpi_op):
        _finish(buf, op, nan_pass)


def express(t: Transport, buf, op: ReduceOp, totals: array, nbytes: int) -> Callable[[Any], Any] | None:
    """native's whole all-reduce of host arrays of ``buf``'s count, dtype and op on ``t`` as one C call
    (``native_calls.ExpressCall``), where that call does all :func:`allreduce` does: native waits in the one C call,
    starts its persistent request in it, or meets and blocks in it (:func:`_way`), which also finishes what is left
    (avg's division, the NaN pass). It holds ``t.in_use`` meanwhile and counts a finished call, as ``nbytes``, into
    ``totals`` (the plan's stats entry). Called on an array, it returns None once done, NotImplemented (nothing
    sent) for an array it does not take (not writable and C-contiguous), while ``t.in_use`` is held, or where the
    persistent request is not made yet, else what is left for :func:`complete` (``t.in_use`` still held): the
    request still running, or the meeting's (or False: the ranks disagree). None where there is no such call (nor
    for p = 1 or an empty array, which send nothing)."""
    calls, reduction = load_calls(), one_call(t, buf, op)
    if reduction is None:
        return None
    way = _way(t, buf.nbytes, calls)
    if way not in (_ONE_CALL, _MEET, _PERSISTENT, _WATCHED) or (way == _PERSISTENT and buf.nbytes > _ONE_CALL_UPTO):
        return None
    mpi_op, finish = reduction
    bound: tuple
    if way == _WATCHED:
        bound = (t.fortran, mpi_op.py2f(), finish, t.watch)
    elif way == _PERSISTENT:
        persistent = t.persistent_requests.setdefault(_persistent_key(buf, op, mpi_op), [])
        if persistent is None:  # (the library has none)
            return None
        bound = (persistent, finish, c_tests(t))  # (filled where it is made: _persistent_allreduce)
    elif way == _MEET:
        bound = (t.fortran, mpi_op.py2f(), finish, _MEETING_TESTS, _kind(buf.dtype, op.name), _meeting(t))
    else:
        bound = (t.fortran, mpi_op.py2f(), finish, c_tests(t))
    return calls.ExpressCall(bound, t.in_use, totals, float(nbytes))


def one_call(t: Transport, buf, op: ReduceOp) -> tuple[MPI.Op, int] | None:
    """The MPI op and ``native_calls``' finish with which one C call reduces ``buf`` with ``op`` on ``t`` and leaves
    nothing after it (native's :func:`express`, rhd's exchange); None where it cannot: no extension, not a host
    array of a dtype it takes (``_C_DTYPES``) on a host transport, p = 1 or nothing to send, float min/max as integer
    keys, or a pass left after the call."""
    if load_calls() is None or type(buf) is not np.ndarray or buf.dtype not in _C_DTYPES or t.size == 1 \
            or not buf.nbytes or not isinstance(t, Transport):
        return None
    how = _how(t, buf, op)
    if how is None:
        return None
    mpi_op, finish, nan_pass = how
    return None if finish == 0 and (op.divisor != 1 or nan_pass) else (mpi_op, finish)


def complete(t: Transport, buf, op: ReduceOp, outcome) -> None:
    """The rest of an all-reduce whose :func:`express` call returned ``outcome``: its request still running, waited
    for within the deadline (a persistent one's result then copied back); or its meeting's, waited for, then
    compared and the blocking call made (False: the ranks disagree, CollectiveMismatchError); or the seconds a
    watched blocking call ran before its communicator was revoked (CommTimeoutError). Then finished as the call
    would have."""
    how = _how(t, buf, op)
    assert how is not None  # (express calls are only made where it is not)
    mpi_op, finish, nan_pass = how
    way = _way(t, buf.nbytes, load_calls())
    if way == _WATCHED:
        _revoked(t, outcome)
    elif way == _MEET:
        _after_meeting(t, buf, op, mpi_op, outcome)
    elif way == _PERSISTENT:
        _wait_started(t, buf, t.persistent_requests[_persistent_key(buf, op, mpi_op)])
    else:
        t.wait_one(MPI.Request.f2py(outcome))
    _finish(buf, op, nan_pass)


def one_call_takes(dtype: np.dtype, op: str, own_min_max: bool) -> bool:
    """Whether :func:`one_call` takes host arrays of ``dtype`` reduced by ``op`` (its name), where the extension is
    built and float min/max are mpcomm's own ops (``own_min_max``) or not: what auto's model assumes of it."""
    return dtype in _C_DTYPES and not (op == AVG and dtype not in KEY_DTYPES) \
        and not (op in _MIN_MAX and dtype in KEY_DTYPES and not own_min_max)


def _how(t: Transport, buf, op: ReduceOp) -> tuple[MPI.Op, int, bool] | None:
    """How native reduces ``buf`` in the library's all-reduce: (the MPI op, the finish native_calls does after it
    as :func:`_allreduce_in_place` takes it, whether a NaN pass is due after the reduction); None for float
    min/max reduced as integer keys. mpcomm's own op (:func:`own_op`) does NaNs and zeros inside the reduction,
    leaving at most avg's division."""
    mine = own_op(t, buf, op)
    if mine is not None:
        return mine, op.divisor if op.divisor != 1 else 0, False
    if op.name in _MIN_MAX and buf.dtype in KEY_DTYPES:
        return None
    nans_matter = buf.dtype.kind in "fc" and t.size > 1
    return op.mpi, op.divisor if nans_matter and buf.dtype in KEY_DTYPES else int(nans_matter and op.divisor == 1), \
        nans_matter


def _finish(buf, op: ReduceOp, nan_pass: bool) -> None:
    """After the library's all-reduce of ``buf`` (not finished in native_calls): avg's division, and numpy's NaN
    wherever a NaN came out (``nan_pass``)."""
    if op.divisor == 1 and not nan_pass:
        return
    found = finish_floats(buf, op.divisor)  # (float32/float64: both in one pass)
    if found is not None:
        if found and nan_pass:
            _canonical_nans(buf)
        return
    if op.divisor != 1:
        op.finish(buf)
    if nan_pass:
        if buf.size <= _SMALL:  # (_has_nan's test, inline: the small all-reduce is the latency-bound one)
            total = sum(buf.tolist())
            if total == total:
                return
        _canonical_nans(buf)


def reduce(t: Transport, sendbuf, recvbuf, op: ReduceOp, root: int = 0) -> None:
    """``recvbuf`` on ``root`` <- the reduction (``recvbuf`` may be None elsewhere)."""
    mine = _min_max_op(t, sendbuf, op)
    if mine is None and op.name in _MIN_MAX and sendbuf.dtype in KEY_DTYPES:
        keys = to_keys(_copy(t, sendbuf), op.name)
        result = recvbuf.view(keys.dtype) if t.rank == root else None
        t.wait_one(t.mpi.Ireduce(keys, result, op.mpi, root))
        if t.rank == root:
            from_keys(result)
        return
    t.wait_one(t.mpi.Ireduce(sendbuf, recvbuf if t.rank == root else None, mine or op.mpi, root))
    if t.rank == root:
        op.finish(recvbuf)


def reduce_scatter(t: Transport, sendbuf, recvbuf, op: ReduceOp) -> None:
    mine = _min_max_op(t, sendbuf, op)
    if mine is None and op.name in _MIN_MAX and sendbuf.dtype in KEY_DTYPES:
        keys = to_keys(_copy(t, sendbuf), op.name)
        t.wait_one(t.mpi.Ireduce_scatter_block(keys, recvbuf.view(keys.dtype), op.mpi))
        from_keys(recvbuf.view(keys.dtype))
        return
    t.wait_one(t.mpi.Ireduce_scatter_block(sendbuf, recvbuf, mine or op.mpi))
    op.finish(recvbuf)


def all_gather(t: Transport, sendbuf, recvbuf) -> None:
    t.wait_one(t.mpi.Iallgather(t._wire(sendbuf), t._wire(recvbuf)))


def broadcast(t: Transport, buf, root: int = 0) -> None:
    t.wait_one(t.mpi.Ibcast(t._wire(buf), root))


def gather(t: Transport, sendbuf, recvbuf, root: int = 0) -> None:
    t.wait_one(t.mpi.Igather(t._wire(sendbuf), t._wire(recvbuf) if t.rank == root else None, root))


def scatter(t: Transport, sendbuf, recvbuf, root: int = 0) -> None:
    t.wait_one(t.mpi.Iscatter(t._wire(sendbuf) if t.rank == root else None, t._wire(recvbuf), root))


def all_to_all(t: Transport, sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs) -> None:
    t.wait_one(t.mpi.Ialltoall(t._wire(sendbuf), t._wire(recvbuf)))


def all_to_all_v(t: Transport, sendbuf, send_counts, send_displs, recvbuf, recv_counts, recv_displs) -> None:
    size = sendbuf.itemsize

    def spec(buf, counts, displs):
        buf, datatype = t._wire(buf)
        return [buf, ([c * size for c in counts], [d * size for d in displs]), datatype]

    t.wait_one(t.mpi.Ialltoallv(spec(sendbuf, send_counts, send_displs), spec(recvbuf, recv_counts, recv_displs)))


# ------------------------------------------------------------------------------------------ helpers
def _allreduce_in_place(t: Transport, buf, op: ReduceOp, finish: int = 0, mpi_op=None) -> bool:
    """``buf`` <- the library's all-reduce of ``buf`` with ``mpi_op`` (default ``op``'s), waited for within the
    deadline the way that is cheapest on this MPI library for its size (``mpcomm.mpi_library``); True if it was
    also finished as ``finish`` asks (1: NaNs made canonical; d > 1: float32/float64 divided by d first), done in
    ``native_calls``' one C call; else the caller finishes."""
    mpi_op = op.mpi if mpi_op is None else mpi_op
    if type(buf) is np.ndarray and t.size > 1:
        calls = load_calls()
        way = _way(t, buf.nbytes, calls)
        if way == _WATCHED:
            outcome = calls.watched_allreduce(t.watch, buf, mpi_op.py2f(), finish)
            if outcome is None:
                return finish != 0
            if outcome is not NotImplemented:
                _revoked(t, outcome)
        if way == _PERSISTENT:
            key = _persistent_key(buf, op, mpi_op)
            persistent = t.persistent_requests.get(key) or _persistent_allreduce(t, buf, mpi_op, key)
            if persistent is not None:
                return _start(t, buf, persistent, calls if buf.nbytes <= _ONE_CALL_UPTO else None, finish)
            way = _way(t, buf.nbytes, calls, persistent=False)  # (an MPI before MPI-4)
        if way == _MEET:
            return _meet_then_block(t, buf, op, mpi_op, finish)
        if way == _ONE_CALL:
            request = calls.allreduce(t.fortran, buf, mpi_op.py2f(), finish, c_tests(t))
            if request is None:
                return finish != 0
            if request is not NotImplemented:
                t.wait_one(MPI.Request.f2py(request))
                return False
        if way == _FROM_COPY:
            _wait(t, t.mpi.Iallreduce(_copy(t, buf, "native.input"), buf, mpi_op))
            return False
    _wait(t, t.mpi.Iallreduce(MPI.IN_PLACE, buf, mpi_op))
    return False


def _way(t: Transport, nbytes: int, calls, persistent: bool = True) -> str:
    """How native waits for an all-reduce of ``nbytes`` (of a host array, p > 1) on ``t`` within the deadline, by
    the library's profile (``mpcomm.mpi_library``) and whether ``native_calls`` is loaded (``calls``): the same on
    every rank."""
    if t.watch is not None:
        return _WATCHED
    profile = library()
    if persistent and nbytes <= profile.persistent_upto and t.starts_persistent:
        return _PERSISTENT
    if meets_then_blocks(t, profile, nbytes):
        return _MEET
    if polled_from_copy(t, profile, nbytes):
        return _FROM_COPY
    return _ONE_CALL if calls is not None and nbytes <= _ONE_CALL_UPTO else _MPI4PY


def watch(t: Transport, *alike: Transport) -> None:
    """Collective over ``t`` (where the Communicator makes it, its topology set): native's all-reduces on ``t`` and
    on the transports ``alike`` it (its ranks, nodes and cores) become the library's blocking call, its deadline kept
    by the watchdog (``native_calls.Watch``), where the library can revoke a communicator and its fault tolerance is
    enabled (Open MPI launched with ``mpiexec --with-ft ulfm``), MPI runs threads at once, the ranks share one node
    with a core each (the blocking call spins) and every rank can (they agree once, over ``t``: the same way on
    every rank)."""
    calls = load_calls()
    mine = int(fault_tolerant() and MPI.Query_thread() == MPI.THREAD_MULTIPLE
               and not t.spans_nodes and not t.cores_shared and t.size > 1)
    everyone = np.array([mine], np.int64)
    if t.size > 1:
        _wait(t, t.mpi.Iallreduce(MPI.IN_PLACE, everyone, MPI.MIN))
    if everyone[0]:
        for u in (t, *alike):
            u.watch = calls.Watch(u.fortran, u.timeout)


def _revoked(t: Transport, seconds: float) -> None:
    """CommTimeoutError for a watched blocking call that ran ``seconds`` until its communicator was revoked: by
    this rank's watchdog at the deadline, or by another rank's at its own."""
    t.failed = True
    raise CommTimeoutError(str(t.operation), t.others, seconds, t.timeout, t.rank,
                           "the communicator was revoked (a rank's watchdog saw a call run past the deadline); "
                           + CommTimeoutError.UNUSABLE)


def own_op(t: Transport, buf, op: ReduceOp):
    """mpcomm's own ``op`` as an MPI op (``native_calls.reduction_ops``) where native reduces ``buf`` on ``t`` with
    it, else None: float min/max and float sums, avgs and products (``_OP_DTYPES``) in the sizes the library's
    profile gives them (``mpcomm.mpi_library``), of host buffers, on a transport whose ranks agreed on them when it
    was made (:func:`agree_on_ops`). The same answer on every rank for the same call, and no communication: a
    call that skips this module (the torch backend's C++ all-reduce) asks it too. (Sizes first: a small sum is the
    latency-bound call.)"""
    entry = t.reduction_ops.get(op.name)
    if entry is None:
        return None
    own, above, upto = entry
    nbytes = buf.nbytes
    if nbytes <= above or (upto is not None and nbytes > upto) or buf.dtype not in _OP_DTYPES[op.name]:
        return None
    return own if type(buf) is np.ndarray else None


def agree_on_ops(t: Transport) -> dict:
    """Collective over ``t`` (where it is made: never in the middle of calls, which some ranks may make without
    this module): op name -> (mpcomm's MPI op, the bytes of the all-reduces it is used for: more than, at most
    (None: any)), as the library's profile says and where every rank of ``t`` can make them, else {}. The op that
    reduces must be the same on every rank (and so is the profile)."""
    profile = library()
    above, upto = profile.arithmetic_op_bytes
    arithmetic = upto is None or upto > above
    if t.size == 1 or t.spans_nodes or not (profile.min_max_op or arithmetic):  # (nodes: see mpi_library.Library)
        return {}
    ops = reduction_ops()
    everyone = np.array([len(ops)], np.int64)
    _wait(t, t.mpi.Iallreduce(MPI.IN_PLACE, everyone, MPI.MIN))
    if not everyone[0]:
        return {}
    agreed: dict[str, tuple[MPI.Op, int, int | None]] = {}
    if profile.min_max_op:
        agreed.update({MIN: (ops[MIN], -1, None), MAX: (ops[MAX], -1, None)})
    if arithmetic:
        agreed.update({SUM: (ops[SUM], above, upto), AVG: (ops[SUM], above, upto), PROD: (ops[PROD], above, upto)})
    return agreed


def _min_max_op(t: Transport, buf, op: ReduceOp):
    """mpcomm's own MPI op for a float min/max of ``buf`` where :func:`own_op` gives it, else None (reduce and
    reduce-scatter keep MPI's ops for the rest: their results are not compared across ranks)."""
    return own_op(t, buf, op) if op.name in _MIN_MAX else None


def meets_then_blocks(t: Transport, profile: Library, nbytes: int) -> bool:
    """Whether an all-reduce of ``nbytes`` on ``t`` meets, then makes the blocking call (the same on every rank).
    Never across nodes: a link lost in the middle of the blocking call would hold it past the deadline, forever."""
    return (profile.blocking_above is not None and nbytes > profile.blocking_above and not t.spans_nodes
            and (profile.blocking_on_shared_cores or not t.cores_shared))


def polled_from_copy(t: Transport, profile: Library, nbytes: int) -> bool:
    """Whether the non-blocking all-reduce native polls for ``nbytes`` on ``t`` reduces a copy of the input into
    the buffer, not the buffer in place: where the library's profile says it runs a faster algorithm so
    (``Library.polled_from_copy``). The same on every rank."""
    return (copies_input(profile.polled_from_copy, 2 if t.spans_nodes else 1, t.size, nbytes)
            and not meets_then_blocks(t, profile, nbytes))


def _start(t: Transport, buf, persistent: list, calls, finish: int) -> bool:
    """``buf`` <- the all-reduce of ``persistent`` (request, its buffer, its Fortran handle) started on ``buf``'s
    values; True if it was also finished as ``finish`` asks (in ``native_calls``' one call)."""
    request, own, handle = persistent
    done = NotImplemented if calls is None else calls.start(handle, own, buf, finish, c_tests(t))
    if done is NotImplemented:  # (mpi4py's calls: the same MPI calls, one by one)
        own[...] = buf
        request.Start()
        done, finish = False, 0
    if done:
        return finish != 0
    _wait_started(t, buf, persistent)
    return False


def _wait_started(t: Transport, buf, persistent: list) -> None:
    """``buf`` <- the result of ``persistent``'s all-reduce, started, once done within the deadline."""
    request, own, _ = persistent
    if not (request.Test() or request.Test()):  # (not wait_one: a timeout would cancel the request,
        t.poll_until(request.Test, t.others)  # and MPICH aborts on MPI_Cancel of a persistent collective)
    buf[...] = own.reshape(buf.shape)  # (the express call's buf keeps the caller's shape)


def _wait(t: Transport, request) -> None:
    if not (request.Test() or request.Test()):  # (most small ones are done by the second Test at p = 2)
        t.wait_one(request)


def _persistent_key(buf, op: ReduceOp, mpi_op) -> tuple:
    """The kind of a persistent all-reduce: count, dtype, op and whether the library's own MPI op reduces it."""
    return buf.size, buf.dtype, op.name, mpi_op is op.mpi


def _persistent_allreduce(t: Transport, buf, mpi_op, key: tuple) -> list | None:
    """The [request, its buffer, its Fortran handle] of this transport's persistent all-reduce of ``buf``'s count,
    dtype and op (``key``), made on first use into the list kept for ``key`` (an express call may hold it already);
    None where the library has none (every rank alike: it is the same library). Made in the order of the calls, the
    same on every rank; past ``_PERSISTENT_KEPT`` kinds made all are freed (the same on every rank)."""
    kept = t.persistent_requests
    persistent = kept.get(key)
    if persistent is None and key in kept:
        return None
    if sum(1 for made in kept.values() if made) >= _PERSISTENT_KEPT:
        t.free_persistent_requests()
    own = np.empty_like(buf)
    try:
        request = t.mpi.Allreduce_init(MPI.IN_PLACE, own, mpi_op)
    except (NotImplementedError, MPI.Exception):  # an MPI before MPI-4 (or built without it)
        kept[key] = None
        return None
    persistent = kept.setdefault(key, [])
    persistent[:] = (request, own, request.py2f())
    return persistent


def _meet_then_block(t: Transport, buf, op: ReduceOp, mpi_op, finish: int) -> bool:
    """The ranks meet (:func:`_meet`), then make the library's blocking all-reduce of ``buf``: both in
    ``native_calls``' one C call where it is built and the meeting is done within its tests (True if it also
    finished as ``finish`` asks), else through mpi4py's calls."""
    calls = load_calls()
    outcome = NotImplemented if calls is None else \
        calls.meet_allreduce(t.fortran, buf, mpi_op.py2f(), finish, _MEETING_TESTS, _kind(buf.dtype, op.name),
                             _meeting(t))
    if outcome is None:
        return finish != 0
    _after_meeting(t, buf, op, mpi_op, outcome)
    return False


def _after_meeting(t: Transport, buf, op: ReduceOp, mpi_op, outcome) -> None:
    """What a meeting C call left (``outcome``: the meeting's request still running, False where the ranks
    disagree, NotImplemented where it made no meeting) done in Python: the meeting, compared, then the blocking
    all-reduce of ``buf`` (not finished)."""
    if outcome is NotImplemented:
        _meet(t, buf, op, _kind(buf.dtype, op.name))
    else:
        if outcome is not False:  # (the meeting still runs: waited for within the deadline)
            t.wait_one(MPI.Request.f2py(outcome))
        _check_met(t, buf, op, _meeting(t)[4:])
    t.mpi.Allreduce(MPI.IN_PLACE, buf, mpi_op)


def _meeting(t: Transport):
    """The 8 int64 a meeting C call writes on ``t``: (count, kind, -count, -kind) and their maxima over the ranks."""
    return t.scratch("native.meeting", 8, np.int64)


@functools.cache
def _kind(dtype: np.dtype, op_name: str) -> int:
    """A number for (dtype, op), the same on every rank, that the meeting compares."""
    return zlib.crc32(f"{dtype.str} {op_name}".encode())


def _meet(t: Transport, buf, op: ReduceOp, kind: int) -> None:
    """Wait, within the deadline, until every rank has come to this all-reduce of the same count, dtype and op
    (``kind``), so that the blocking call made next cannot wait for a rank that is not coming (or pair with another
    call); CollectiveMismatchError on every rank where they differ."""
    mine = np.array([buf.size, kind, -buf.size, -kind], dtype=np.int64)  # max of x and of -x: the extremes
    extremes = np.empty_like(mine)
    _wait(t, t.mpi.Iallreduce(mine, extremes, MPI.MAX))
    _check_met(t, buf, op, extremes)


def _check_met(t: Transport, buf, op: ReduceOp, extremes) -> None:
    """CollectiveMismatchError unless the meeting's ``extremes`` (the max of count, kind, -count, -kind) show every
    rank with the same count and kind."""
    if extremes[0] != -extremes[2] or extremes[1] != -extremes[3]:
        raise CollectiveMismatchError(
            f"rank {t.rank}: {t.operation}: the ranks called the MPI library's all-reduce with different counts, "
            f"dtypes or ops (this rank: {buf.size} x {buf.dtype}, {op.name}); nothing was sent")


def _copy(t: Transport, array, slot: str = "native.keys"):
    copy = t.scratch(slot, array.size, array.dtype, like=array)
    copy[...] = array
    return copy


def _canonical_nans(floats) -> None:
    """In place: every NaN (real or imaginary part) becomes numpy's ``nan``, the same bits on every rank."""
    if _has_nan(floats):
        parts = floats.view(_REAL[floats.dtype]) if floats.dtype.kind == "c" else floats
        parts[np.isnan(parts)] = np.nan


def _has_nan(floats) -> bool:
    """Whether ``floats`` (real or complex) may hold a NaN: small arrays by their sum in Python (a NaN anywhere
    makes it NaN; so does inf - inf, which only costs a needless pass), larger ones by the element ``argmax``
    picks (numpy's argmax takes the first NaN as the maximum: one pass, no temporary array, no overflow
    warnings, and a third of the cost of ``max()`` up to a few KiB)."""
    if floats.ndim != 1:
        floats = floats.reshape(-1)
    if floats.size <= _SMALL:
        total = sum(floats.tolist())
        return total != total
    if floats.dtype.kind == "c":
        floats = floats.view(_REAL[floats.dtype])
    largest = floats[floats.argmax()]
    return largest != largest
