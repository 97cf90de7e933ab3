"""Tracing: the flight recorder every Communicator writes into, and the analyzer of its dumps.

* :mod:`mpcomm.trace.recorder` — the ring of this process's last calls and its dump (torch's flight-recorder
  format), written on a timeout, an unusable communicator, SIGUSR1 or ``comm.dump_trace()``.
* :mod:`mpcomm.trace.analyze` — reads every rank's dump and says which rank is behind or diverging
  (``python -m mpcomm.trace DIR`` or ``mpcomm-trace DIR``).
"""
from __future__ import annotations

from .recorder import (
    DEFAULT_BUFFER,
    FILE_PREFIX,
    FlightRecorder,
    GroupTrace,
    default_dir,
    dump_trace,
    process_recorder,
)

__all__ = ["DEFAULT_BUFFER", "FILE_PREFIX", "FlightRecorder", "GroupTrace", "default_dir", "dump_trace",
           "process_recorder"]
