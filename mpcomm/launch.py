"""How mpcomm's programs end under ``mpiexec``: user errors as one line, failures as one abort, never a hang.

* :func:`run_main` runs a command-line ``main``. A **user error** (a bad argument or configuration, an unwritable
  output: :class:`UsageError`, or argparse's exit) is seen alike by every rank, because every rank parses the same
  argv and checks the same configuration: the ranks confirm that with one barrier bounded by
  ``AGREE_SECONDS``, rank 0 prints the one line, and every rank exits with the same status (2) — no
  ``MPI_Abort``, so no output is lost to it. If only some ranks saw the error, they print it and abort the job.
  Any **other exception** prints its traceback with the rank and aborts the job, as ``python -m mpi4py`` does;
  otherwise the other ranks would wait in their next collective until a timeout (or forever, inside MPI).
* :func:`install_excepthook` (done by ``import mpcomm`` when the world has more than one rank) does the same for
  an :class:`~mpcomm.errors.MpcommError` escaping a plain ``mpiexec -n P python script.py``: without it a
  rank that hit a ``CommTimeoutError`` exits while its peers stay blocked until the job is killed.

With a single process nothing is aborted: exceptions and exits propagate normally.
"""
from __future__ import annotations

import argparse
import array
import fcntl
import os
import sys
import termios
import time
import traceback
from typing import Any, Callable, TypeVar

import numpy as np
from mpi4py import MPI

from .errors import MpcommError

T = TypeVar("T")
USAGE_STATUS = 2  # argparse's exit status for a bad command line; used for every user error
AGREE_SECONDS = 10.0  # how long ranks that hit a user error wait for the others to report the same


class UsageError(MpcommError):
    """A mistake in what the user asked for: a CLI reports it as one line (``prog: error: ...``), exit status 2."""


class ArgumentError(SystemExit):
    """argparse's exit for a bad command line (status 2), carrying its one-line message for :func:`run_main`."""

    def __init__(self, line: str):
        super().__init__(USAGE_STATUS)
        self.line = line


class ArgumentParser(argparse.ArgumentParser):
    """argparse for a program every rank runs: help and errors are printed by rank 0 only, an error is one line
    (``prog: error: message``) and raises :class:`ArgumentError` on every rank (they parse the same argv)."""

    def _print_message(self, message, file=None):
        if _rank() == 0:
            super()._print_message(message, file)

    def error(self, message: str):
        line = f"{self.prog}: error: {message} (see {self.prog} --help)"
        if _rank() == 0:
            _flush()
            print(line, file=sys.stderr, flush=True)
        raise ArgumentError(line)


# ---------------------------------------------------------------------------------------- checks before a run
def output_problem(path: str, option: str) -> str | None:
    """Why ``path`` (the value of ``option``) cannot be written, or None: checked before a run, not after it."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{option} {path}: is a directory"
    if not os.path.exists(directory):
        return f"{option} {path}: directory {directory} does not exist"
    if not os.path.isdir(directory):
        return f"{option} {path}: {directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{option} {path}: directory {directory} is not writable"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{option} {path}: the file is not writable"
    return None


def root_outputs_problem(comm, outputs: dict[str, str | None]) -> str | None:
    """Collective: the first problem rank 0 (the rank that writes) finds with ``outputs`` ({option: path}), or
    None, on every rank (two broadcasts over the mpcomm ``comm``, bounded by its timeout)."""
    text = b""
    if comm.rank == 0:
        found = (output_problem(path, option) for option, path in outputs.items() if path)
        text = (next((p for p in found if p), None) or "").encode()
    length = np.array([len(text)], dtype=np.int64)
    comm.broadcast(length, root=0)
    if not length[0]:
        return None
    data = np.frombuffer(text, dtype=np.uint8).copy() if comm.rank == 0 else np.empty(int(length[0]), np.uint8)
    comm.broadcast(data, root=0)
    return data.tobytes().decode()


# ---------------------------------------------------------------------------------------- ending the job
def _rank() -> int:
    return MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else 0


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


def _everyone_arrives(comm: MPI.Comm, seconds: float) -> bool:
    """Whether every rank of ``comm`` enters this barrier within ``seconds``."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + seconds
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _end_with_user_error(agree: MPI.Comm, line: str | None, status: int, printed_by_rank0: bool) -> None:
    """Every rank hit a user error: rank 0 prints the line(s) once, all exit with the same status. Only some did:
    they print theirs and abort the job (the others are not coming)."""
    if not _everyone_arrives(agree, AGREE_SECONDS):
        shown = line is None or (printed_by_rank0 and agree.Get_rank() == 0)
        _report_to_stderr(("" if shown else f"{line}\n") + f"[mpcomm] rank {agree.Get_rank()} of {agree.Get_size()} "
                          f"stopped (status {status}), the other ranks did not within {AGREE_SECONDS:g} s; "
                          "aborting the job\n")
        abort(status)
    everyone = agree.allgather((line, status))  # every rank is here: these collectives complete
    if agree.Get_rank() == 0:
        printed = {line} if printed_by_rank0 else set()
        text = "".join(f"{msg}\n" for msg, _ in dict.fromkeys(everyone) if msg is not None and msg not in printed)
        if text:
            _report_to_stderr(text)
    agree.Barrier()  # no rank exits before rank 0's line is out
    agree.Free()
    raise SystemExit(max(code for _, code in everyone))


def run_main(main: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``main(*args, **kwargs)`` as a command-line program of a (possibly multi-process) job.

    A :class:`UsageError` or a nonzero ``SystemExit`` (argparse) ends every rank with status 2 and one line from
    rank 0; any other exception, on any rank, aborts the job after printing its traceback. Usage (a console-script
    entry point)::

        def main():
            return run_main(_main, sys.argv[1:])
    """
    if _world_size() == 1:
        try:
            return main(*args, **kwargs)
        except UsageError as exc:
            print(exc, file=sys.stderr, flush=True)
            raise SystemExit(USAGE_STATUS) from None
    agree = MPI.COMM_WORLD.Dup()  # private: an agreement must never match a collective of the program's own
    try:
        result = main(*args, **kwargs)
    except UsageError as exc:
        _end_with_user_error(agree, str(exc), USAGE_STATUS, printed_by_rank0=False)
        raise  # pragma: no cover - _end_with_user_error does not return
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            agree.Free()
            raise
        if isinstance(exc, ArgumentError):
            _end_with_user_error(agree, exc.line, USAGE_STATUS, printed_by_rank0=True)
        elif isinstance(exc.code, int):
            _end_with_user_error(agree, None, exc.code, printed_by_rank0=False)
        _end_with_user_error(agree, str(exc.code), 1, printed_by_rank0=False)  # sys.exit("message")
        raise  # pragma: no cover
    except BaseException:  # noqa: BLE001 - KeyboardInterrupt must end the job as well
        _report_to_stderr(f"[mpcomm] rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()} raised; "
                          f"aborting the job:\n{traceback.format_exc()}")
        abort(1)
        raise  # pragma: no cover
    agree.Free()
    return result


# ---------------------------------------------------------------------------------------- plain scripts
def install_excepthook() -> None:
    """Make an uncaught :class:`~mpcomm.errors.MpcommError` end the whole job (multi-rank worlds only).

    Chained to the hook in place: other exceptions, single-process runs and interactive sessions go to it unchanged.
    The error is printed once, with the rank, in one write drained before ``MPI_Abort``.
    """
    if _world_size() <= 1 or getattr(sys.excepthook, "mpcomm_chained", None) is not None:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        if not issubclass(exc_type, MpcommError) or _world_size() <= 1 or hasattr(sys, "ps1") or sys.flags.interactive:
            previous(exc_type, exc, tb)
            return
        header = (f"[mpcomm] rank {MPI.COMM_WORLD.Get_rank()} of {MPI.COMM_WORLD.Get_size()}: uncaught "
                  f"{exc_type.__name__}; aborting the job\n")
        if previous is sys.__excepthook__:
            _report_to_stderr(header + "".join(traceback.format_exception(exc_type, exc, tb)))
        else:  # someone else's hook prints it their way
            previous(exc_type, exc, tb)
            _report_to_stderr(header)
        abort(1)

    setattr(hook, "mpcomm_chained", previous)  # (a function attribute: mypy knows none on Callables)
    sys.excepthook = hook
