"""One process group's collectives, run one at a time in the order they were issued, and torch's ``Work`` for them.

Every collective of a group goes through its :class:`Lane`, so the k-th collective issued on a rank pairs with the
k-th on every other rank, whether the caller waits on it at once or not (as on gloo, one stream per group). Where
it runs:

* a call that torch marks synchronous (``opts.asyncOp`` false: ``dist.all_reduce(t)``) runs right away on the
  caller's thread when nothing issued before it is pending: no thread hop, no future;
* anything else is queued and run by the lane's worker thread in issue order, so DDP's bucket all-reduces make
  progress while backward computes; a ``wait()`` that finds its job (and those before it) still queued runs
  them itself instead of waiting for the worker to wake.

A job's future is completed outside the lane (no thread holds it then), and the worker hands its role to a new
thread while it completes one: torch runs a future's callbacks on the thread that completes it, and a callback may
issue a collective on this group and block on it (torch's ``powerSGD_hook`` does), which only a free lane can run.

The callbacks of a job's future also come first in the order: a collective a callback issues goes ahead of those
queued by other threads, and no collective queued by another thread starts until the callbacks have returned or
sit blocked on one they issued (or on any queued collective's ``wait()``). So DDP's bucket all-reduces and the
ones PowerSGD's callbacks issue per bucket pair up alike on every rank, whichever thread gets there first (on gloo
they race). The order is the same on every rank when a thread attaches its callbacks before it issues its next
collective on the group (as DDP's hooks do). A callback that blocks on anything else (a collective queued after
it by another thread, a lock) would hold the lane forever: once its thread has used no CPU for
``CALLBACK_IDLE_S`` seconds the lane stops waiting for it and warns that the group's order is then the order in
which threads issue their collectives.

A failure is raised by the synchronous call, by ``wait()``, and through ``get_future()``; never swallowed.
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
from torch.futures import Future

from .tensors import torch_error


CALLBACK_IDLE_S = 2.0  # a callback thread idle this long is blocked on something the lane cannot see


class Callbacks:
    """One thread running the callbacks of a finished job's future: the jobs it issued that have not finished, and
    whether it is blocked (then the lane may run queued jobs) or may still issue one (then the lane waits)."""

    __slots__ = ("pending", "waiting", "released", "_clock", "_cpu", "_since")

    def __init__(self) -> None:
        self.pending = 0  # jobs issued from these callbacks, not yet done
        self.waiting = 0  # Lane.wait() calls of this thread in progress
        self.released = False  # blocked on something else for CALLBACK_IDLE_S: holds nothing any more
        clock = getattr(time, "pthread_getcpuclockid", None)
        self._clock = clock(threading.get_ident()) if clock is not None else None
        self._cpu: float | None = None
        self._since: float | None = None

    def holds(self, lane: str) -> bool:
        """Whether the lane must wait for these callbacks: they run (neither blocked on a job they issued nor in a
        wait()), and their thread used CPU in the last CALLBACK_IDLE_S seconds."""
        if self.released or self.pending or self.waiting:
            self._since = None
            return False
        now = time.monotonic()
        cpu = time.clock_gettime(self._clock) if self._clock is not None else None
        if self._since is None or cpu != self._cpu:
            self._since, self._cpu = now, cpu
            return True
        if now - self._since < CALLBACK_IDLE_S:
            return True
        self.released = True
        warnings.warn(f"mpcomm backend: a future callback on process group {lane} has been blocked for "
                      f"{CALLBACK_IDLE_S:g} s on something other than a collective it issued; the group's "
                      "collectives now run in the order threads issue them, which may differ between ranks",
                      RuntimeWarning, stacklevel=2)
        return False


class Job:
    """A collective waiting to run (or done): its body, what its Work returns, how it ended, and the future
    callbacks that issued it (if any)."""

    __slots__ = ("body", "result", "operation", "error", "done", "future", "issuer")

    def __init__(self, body: Callable[[], Any] | None, result: Any, operation: str):
        self.body: Callable[[], Any] | None = body  # None once run (and in the _NEVER marker)
        self.result, self.operation = result, operation
        self.error: BaseException | None = None
        self.done = False
        self.future: Future | None = None
        self.issuer: Callbacks | None = None

    def run(self) -> None:
        try:
            assert self.body is not None, "a job runs once"
            self.body()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait() / the future
            self.error = torch_error(exc, self.operation)
        self.body = None  # drop the buffers it closed over


class Lane:
    """Runs a group's jobs one at a time in issue order (see the module docstring); ``on_failure`` is called
    when a job's communication fails."""

    def __init__(self, name: str, threaded: bool = True, on_failure: Callable[[], None] = lambda: None):
        self._name, self._threaded, self._on_failure = name, threaded, on_failure
        self._queue: deque[Job] = deque()
        self._front: deque[Job] = deque()  # jobs issued from future callbacks: they run before _queue's
        self._callbacks: dict[int, list[Callbacks]] = {}  # thread id -> the callbacks it runs (innermost last)
        self._running = threading.Lock()  # held by whichever thread runs a job
        self._changed = threading.Condition(threading.Lock())  # guards the queues, _callbacks and Job.done
        self._worker: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ the synchronous path
    def enter(self) -> bool:
        """Take the lane for a job run on the caller's thread; False if jobs issued earlier are still pending, or
        if another thread's future callbacks may yet issue one (then the job is queued behind theirs)."""
        if self._front or self._queue or self._others_run_callbacks() or not self._running.acquire(False):
            return False
        if self._front or self._queue or self._others_run_callbacks():  # changed between the check and the lock
            self._running.release()
            return False
        return True

    def _others_run_callbacks(self) -> bool:
        return bool(self._callbacks) and (len(self._callbacks) > 1 or threading.get_ident() not in self._callbacks)

    def leave(self) -> None:
        self._running.release()
        if self._queue or self._front:
            with self._changed:
                self._changed.notify_all()

    # ------------------------------------------------------------------ the queued path
    def submit(self, job: Job) -> None:
        """Queue ``job``; without a worker (MPI below THREAD_MULTIPLE) run it, and all before it, now."""
        if self._closed:
            raise RuntimeError(f"mpcomm backend: {job.operation} on process group {self._name}, which was shut down")
        with self._changed:
            frames = self._callbacks.get(threading.get_ident())
            if frames:
                job.issuer = frames[-1]
                job.issuer.pending += 1
                self._front.append(job)
            else:
                self._queue.append(job)
            if self._threaded:
                if self._worker is None:
                    self._start_worker()
                self._changed.notify_all()
        if not self._threaded:
            self.wait(job, None)

    def wait(self, job: Job, timeout: float | None) -> None:
        """Block until ``job`` is done; raises DistBackendError if ``timeout`` seconds pass first (the job itself
        goes on). Without a timeout, a job still queued (and those before it) runs here when no thread is running
        one (a job run here cannot be given up on: with a timeout the worker runs it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        steal = timeout is None or not self._threaded
        frame = self._innermost_callbacks()
        if frame is not None:  # blocked: the lane need not wait for these callbacks meanwhile
            with self._changed:
                frame.waiting += 1
                self._changed.notify_all()
        try:
            while not job.done:
                if steal and self._running.acquire(False):
                    try:
                        finished = self._run_queued(until=job)
                    finally:
                        self._running.release()
                    if finished is not None:
                        self._complete(finished)
                        continue
                with self._changed:
                    if job.done:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        assert timeout is not None  # a deadline comes from it
                        raise dist.DistBackendError(
                            f"mpcomm backend: {job.operation} on process group {self._name}: Timed out waiting "
                            f"{timeout * 1000:.0f}ms for the collective to complete; it is still running")
                    self._changed.wait(0.05 if remaining is None else min(remaining, 0.05))
        finally:
            if frame is not None:
                with self._changed:
                    frame.waiting -= 1

    def _innermost_callbacks(self) -> Callbacks | None:
        frames = self._callbacks.get(threading.get_ident())
        return frames[-1] if frames else None

    def _next_job(self) -> Job | None:
        """With ``_changed`` held: the job to run next, taken off its queue; None while there is none, or while
        future callbacks may still issue the one that comes next."""
        if self._front:
            return self._front.popleft()
        if self._queue and not self._held():
            return self._queue.popleft()
        return None

    def _runnable(self) -> bool:
        """With ``_changed`` held: whether :meth:`_next_job` would give a job."""
        return bool(self._front) or (bool(self._queue) and not self._held())

    def _held(self) -> bool:
        """With ``_changed`` held: whether some thread's future callbacks run and may still issue a collective."""
        return not self._closed and any(frames[-1].holds(self._name) for frames in self._callbacks.values())

    def _run_queued(self, until: Job | None) -> Future | None:
        """With ``_running`` held: run jobs in order, up to and including ``until`` (one job for None), stopping
        after one whose future is to be completed. That future's callbacks then hold the lane (from before the
        lane is let go) and it is returned, for the caller to complete with :meth:`_complete` outside the lane."""
        while True:
            with self._changed:
                if until is not None and until.done:
                    return None
                job = self._next_job()
                if job is None:
                    return None
            job.run()
            if isinstance(job.error, dist.DistBackendError):  # communication failed (not a bad argument)
                self._on_failure()
            with self._changed:
                job.done = True
                if job.issuer is not None:
                    job.issuer.pending -= 1
                future = job.future
                if future is not None:
                    self._callbacks.setdefault(threading.get_ident(), []).append(Callbacks())
                self._changed.notify_all()
            if future is not None or until is None:
                return future

    def _complete(self, future: Future) -> None:
        """Completes a finished job's trigger future on this thread, which runs the callbacks chained on it
        (outside the lane), then lets the lane go on past them."""
        try:
            future.set_result(None)
        finally:
            me = threading.get_ident()
            with self._changed:
                frames = self._callbacks[me]
                frames.pop()
                if not frames:
                    del self._callbacks[me]
                self._changed.notify_all()

    def _start_worker(self) -> None:
        """With ``_changed`` held: a new thread takes the worker's role."""
        self._worker = threading.Thread(target=self._work, name=f"mpcomm-torch-{self._name}", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._changed:
                while not self._runnable():
                    if self._closed or self._worker is not me:
                        return
                    # while callbacks hold queued jobs back, look again now and then: they may turn out idle
                    self._changed.wait(0.05 if self._queue else None)
            with self._running:
                finished = self._run_queued(until=None)
            if finished is None:
                continue
            with self._changed:  # the callbacks may wait on later jobs: a new worker runs those meanwhile
                self._worker = None
                if (self._queue or self._front) and not self._closed:
                    self._start_worker()
            self._complete(finished)
            with self._changed:
                if self._worker is not None or self._closed:
                    return
                self._worker = me

    def future_of(self, job: Job) -> Future:
        """A torch Future completed (or failed) with the job. The job's own trigger future is made on demand, so jobs
        nobody asks about have none; made before the job is done, the thread that finishes the job sets it, after,
        it is set here. What the caller gets is :func:`outcome` of it."""
        with self._changed:
            if job.future is None:
                job.future = Future()
                if job.done:
                    job.future.set_result(None)
            return outcome(job.future, lambda: job.result, lambda: job.error)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Run what is queued, stop the worker; later jobs are refused."""
        if self._closed:
            return
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join()
        while True:
            with self._running:
                finished = self._run_queued(until=_NEVER)
            if finished is None:
                return
            self._complete(finished)


_NEVER = Job(None, None, "")  # never done: _run_queued(until=_NEVER) drains the queues (callbacks hold none once closed)


def outcome(trigger: Future, result: Callable[[], Any], error: Callable[[], BaseException | None]) -> Future:
    """A Future that, once ``trigger`` is done, holds ``result()`` or fails with ``error()``. The failure is made by
    raising in a ``then`` callback, which fails the future in C++: ``Future.set_exception`` only stores the exception
    as the value plus a Python-side flag, which is lost when the future reaches the caller through torch's C++ (there
    ``wait()`` would return the exception instead of raising it)."""
    def settle(_):
        failure = error()
        if failure is not None:
            raise failure
        return result()

    return trigger.then(settle)


def _done_future() -> Future:
    future = Future()
    future.set_result(None)
    return future


def _seconds(timeout) -> float | None:
    """torch's timeout argument (a timedelta, zero meaning none; or seconds) in seconds, or None."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


# ---------------------------------------------------------------------------------------------- Work
class QueuedWork(dist.Work):
    """The Work of a queued collective: ``wait()`` runs or waits for it and raises its error."""

    __slots__ = ("_lane", "_job")  # (a pybind object with a __dict__ costs microseconds to make and free)

    def wait(self, timeout=None) -> bool:
        job = self._job
        if not job.done:
            self._lane.wait(job, _seconds(timeout))
        if job.error is not None:
            raise job.error
        return True

    def is_completed(self) -> bool:
        return self._job.done

    def is_success(self) -> bool:
        return self._job.done and self._job.error is None

    def exception(self):
        return self._job.error

    def result(self):
        self.wait()
        return self._job.result

    def get_future(self) -> Future:
        return self._lane.future_of(self._job)

    def synchronize(self) -> None:
        self.wait()


def queued_work(lane: Lane, job: Job) -> QueuedWork:
    work = QueuedWork()
    work._lane, work._job = lane, job
    return work


class DoneWork(dist.Work):
    """The Work of a collective that already ran (successfully) on the caller's thread."""

    __slots__ = ("_result",)

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self) -> Future:
        future = Future()
        future.set_result(self._result)
        return future

    def synchronize(self) -> None:
        pass


def done_work(result) -> DoneWork:
    work = DoneWork()
    work._result = result
    return work


class P2PWork(dist.Work):
    """A send or receive in flight on mpcomm's point-to-point channels (not ordered with the collectives, as
    on gloo); ``wait()`` is bounded by the group's timeout and raises what the transfer raised."""

    __slots__ = ("_request", "_tensors", "_operation", "_on_failure", "_done", "_error")
    _done: bool
    _error: BaseException | None

    def wait(self, timeout=None) -> bool:
        if self._error is None and not self._done:
            try:
                self._request.wait(_seconds(timeout))
            except BaseException as exc:  # noqa: BLE001
                self._error = torch_error(exc, self._operation)
                if isinstance(self._error, dist.DistBackendError):
                    self._on_failure()
            self._done = True
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done and self._request.is_completed():
            try:
                self.wait()
            except BaseException:  # noqa: BLE001 - kept for wait()/exception()
                pass
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._tensors

    def get_future(self) -> Future:
        failure = None
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            failure = exc
        return outcome(_done_future(), lambda: self._tensors, lambda: failure)

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """The group rank a receive from any source matched (what ``dist.recv`` reports)."""
        self.wait()
        return int(self._request.source)

    source_rank = _source_rank


def p2p_work(request, tensors, operation: str, on_failure: Callable[[], None]) -> P2PWork:
    work = P2PWork()
    work._request, work._tensors, work._operation, work._on_failure = request, tensors, operation, on_failure
    work._done, work._error = False, None
    return work

