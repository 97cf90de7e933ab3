"""Tracing: the flight recorder every Communicator writes into, and the analyzer of its dumps.

* :mod:`mpcomm.trace.recorder` — the ring of this process's last calls and its dump (torch's flight-recorder
  format), written on a timeout, an unusable communicator, SIGUSR1 or ``comm.dump_trace()``.
* :mod:`mpcomm.trace.analyze` — reads every rank's dump and says which rank is behind or diverging
  (``python -m mpcomm.trace DIR`` or ``mpcomm-trace DIR``).
* :mod:`mpcomm.trace.timeline` — ``comm.timeline(path)`` / ``MPCOMM_TIMELINE``: every rank's calls, their phases and
  the engines' spans as one Chrome-trace JSON (:mod:`~mpcomm.trace.chrome`), clocks aligned by
  :mod:`~mpcomm.trace.clocks`; :mod:`~mpcomm.trace.plot` draws one.
* :mod:`mpcomm.trace.stragglers` — ``MPCOMM_STRAGGLER``: ranks that come late to a collective, reported online.
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
