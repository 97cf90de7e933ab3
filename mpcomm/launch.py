"""Run a command-line ``main`` the way ``python -m mpi4py`` runs a script: one failing rank ends the job.

Without this, an uncaught exception on one rank leaves the other ranks blocked in their next collective
until a timeout (or forever, inside the MPI library's own calls). ``run_main`` prints the traceback with the
rank that raised it, flushes, and calls ``MPI.COMM_WORLD.Abort`` so ``mpiexec`` tears the whole job down.
A nonzero ``SystemExit`` (e.g. an argparse error) aborts with its code too, as mpi4py.run does; with a
single process nothing is aborted and the exception propagates normally.
"""
from __future__ import annotations

import array
import fcntl
import os
import sys
import termios
import time
import traceback
from typing import Any, Callable, TypeVar

from mpi4py import MPI

T = TypeVar("T")


def _world_size() -> int:
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return 1
    return MPI.COMM_WORLD.Get_size()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the abort
            pass


def _report_to_stderr(message: str) -> None:
    """Write ``message`` to file descriptor 2 in one ``write``.

    One write keeps the header and the traceback together: ``mpiexec`` forwards output in the chunks it reads,
    and the abort that follows can tear the forwarder down between two separate writes.
    """
    _flush()
    data = message.encode(errors="replace")
    while data:
        data = data[os.write(2, data):]
    _wait_until_read(2)


def _wait_until_read(fd: int, limit: float = 2.0) -> None:
    """Wait (at most ``limit`` seconds) until whoever reads pipe ``fd`` (``mpiexec``'s proxy) has taken all of it.

    ``MPI_Abort`` kills the job at once; output still sitting in the pipe would be lost with it. ``FIONREAD``
    tells how many bytes are unread; for a terminal or a file it fails or reads 0 and there is nothing to wait for.
    """
    deadline = time.monotonic() + limit
    unread = array.array("i", [0])
    while time.monotonic() < deadline:
        try:
            fcntl.ioctl(fd, termios.FIONREAD, unread, True)
        except OSError:
            return
        if unread[0] == 0:
            return
        time.sleep(0.001)


def abort(status: int = 1) -> None:
    """Flush the standard streams and abort every rank of ``MPI.COMM_WORLD`` with ``status``.

    Some MPI libraries return from ``MPI_Abort`` on the calling rank once the others are being killed;
    the process then exits at once (``os._exit``) instead of unwinding and printing the traceback again.
    """
    _flush()
    MPI.COMM_WORLD.Abort(status)
    os._exit(status)


def run_main(main: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``main(*args, **kwargs)``; if it raises on any rank of a multi-process job, abort the job.

    Usage (a console-script entry point)::

        def main():
            return run_main(_main, sys.argv[1:])
    """
    try:
        return main(*args, **kwargs)
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0 or _world_size() == 1:
            raise
        abort(code if isinstance(code, int) else 1)
        raise  # pragma: no cover - abort does not return
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt must end the job as well
        if _world_size() == 1:
            raise
        _report_to_stderr(f"[mpcomm] rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()} raised; "
                          f"aborting the job:\n{traceback.format_exc()}")
        abort(1)
        raise  # pragma: no cover
