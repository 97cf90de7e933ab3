"""A Communicator's settings: its arguments, else the ``MPCOMM_*`` environment variables, each checked, with the
argument or variable named in every error.

Settings are read on every rank separately, and a rank may see another environment than its peers, so the
Communicator agrees on them before anything else (:func:`agree`): a bad value on one rank, or ranks that
disagree, raise ``ConfigError`` on every rank at once, instead of one rank failing while the others wait.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable, TypeVar

import numpy as np

from .errors import ConfigError
from .trace.recorder import DEFAULT_BUFFER as DEFAULT_TRACE_BUFFER

DEFAULT_TIMEOUT = 30.0
# Below this no exchange can complete (one scheduler time slice is longer): such a timeout only breaks the job.
MIN_TIMEOUT = 1e-3
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
PROGRESS_MODES = ("thread", "wait")
T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """What every rank of a Communicator must agree on."""

    timeout: float = DEFAULT_TIMEOUT
    validate: bool = False
    ranks_per_node: int | None = None
    progress: str = "thread"  # non-blocking collectives: on a progress thread, or run inside wait()
    tuning_file: str | None = None  # auto's table, loaded by the constructor (a collective: every rank or none)
    # Auto's model measures the network between hosts (a collective: every rank or none, and one model everywhere).
    network_probe: bool = True
    staging_chunk: int = 0  # bytes per message of a staged device transfer (both ends must cut alike); 0: default
    cuda_aware: str = ""  # MPCOMM_CUDA_AWARE: direct or staged device transfers send different messages
    trace_buffer: int = 0  # MPCOMM_TRACE_BUFFER: calls the flight recorder keeps (0: off); see mpcomm.trace
    straggler: float = 0.0  # MPCOMM_STRAGGLER: report ranks this many seconds late (0: off); mpcomm.trace.stragglers
    timeline: str = ""  # MPCOMM_TIMELINE: the file of the timeline the first Communicator over the world starts

    @classmethod
    def resolve(cls, timeout=None, validate=None, ranks_per_node=None) -> "Settings":
        """The settings for these constructor arguments (None: from the environment); ConfigError if invalid."""
        trace_buffer = _env_count("MPCOMM_TRACE_BUFFER", "calls the flight recorder keeps, 0: off",
                                  DEFAULT_TRACE_BUFFER)
        timeline = _env("MPCOMM_TIMELINE") or ""
        if timeline and not trace_buffer:
            raise ConfigError(f"MPCOMM_TIMELINE={timeline!r} needs the flight recorder, whose lanes it follows, but "
                              "MPCOMM_TRACE_BUFFER=0 turns it off: unset one of them")
        return cls(
            timeout=_timeout(timeout, "timeout") if timeout is not None else _env_timeout(),
            validate=_flag(validate, "validate") if validate is not None else _env_flag("MPCOMM_VALIDATE"),
            ranks_per_node=(_positive_int(ranks_per_node, "ranks_per_node") if ranks_per_node is not None
                            else _env_positive_int("MPCOMM_RANKS_PER_NODE", "ranks_per_node")),
            progress=_env_choice("MPCOMM_PROGRESS", PROGRESS_MODES, default="thread"),
            tuning_file=_env("MPCOMM_TUNING_FILE") or None,
            network_probe=(_env("MPCOMM_NETWORK_PROBE") or "1").lower() not in _FALSE,
            staging_chunk=_staging_chunk(),
            cuda_aware=(_env("MPCOMM_CUDA_AWARE") or "").lower(),
            trace_buffer=trace_buffer,
            timeline=timeline,
            straggler=_env_seconds("MPCOMM_STRAGGLER", "seconds a rank may come after the others before it is "
                                   "reported, 0: off"),
        )


def agree(transport, settings: Settings | None, problem: str | None) -> None:
    """Collective: every rank's ``settings`` (or the ``problem`` that kept it from having any) on every rank;
    ConfigError everywhere if any rank had a problem or the ranks disagree. Bounded by ``transport``'s deadline."""
    everyone = transport.allgather_object((problem, settings))
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(everyone) if p]
    if problems:
        raise ConfigError(f"Communicator: bad settings — {'; '.join(problems)}")
    differing = [name for name in Settings.__dataclass_fields__
                 if len({getattr(s, name) for _, s in everyone}) > 1]
    if differing:
        described = "; ".join(f"{name} ({_SOURCES[name]}): " + ", ".join(f"rank {r} {getattr(s, name)!r}" for r, (_, s)
                                                                      in enumerate(everyone)) for name in differing)
        raise ConfigError(f"Communicator: the ranks must agree on {', '.join(differing)} — {described}")


_SOURCES = {  # where each setting comes from, for the error that says the ranks disagree
    "timeout": "argument or MPCOMM_TIMEOUT",
    "validate": "argument or MPCOMM_VALIDATE",
    "ranks_per_node": "argument or MPCOMM_RANKS_PER_NODE",
    "progress": "MPCOMM_PROGRESS",
    "tuning_file": "MPCOMM_TUNING_FILE",
    "network_probe": "MPCOMM_NETWORK_PROBE",
    "staging_chunk": "MPCOMM_STAGING_CHUNK",
    "cuda_aware": "MPCOMM_CUDA_AWARE",
    "trace_buffer": "MPCOMM_TRACE_BUFFER",
    "timeline": "MPCOMM_TIMELINE",
    "straggler": "MPCOMM_STRAGGLER",
}


# ------------------------------------------------------------------------------------------ values
def _timeout(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    if value < MIN_TIMEOUT:
        raise ConfigError(f"{name} must be at least {MIN_TIMEOUT:g} s (no exchange completes sooner), got {value!r}")
    return float(value)


def _flag(value, name: str) -> bool:
    if isinstance(value, (bool, np.bool_, Integral)) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{name} must be True or False, got {value!r}")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value!r} (an int, or None; not {type(value).__name__})"
                          if not isinstance(value, Integral) or isinstance(value, bool)
                          else f"{name} must be >= 1, got {value!r}")
    return int(value)


# ------------------------------------------------------------------------------------------ environment
def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


def _env_timeout() -> float:
    parsed = _env_parsed("MPCOMM_TIMEOUT", float, "a finite number of seconds > 0")
    if parsed is None:
        return DEFAULT_TIMEOUT
    value, number = parsed
    try:
        return _timeout(number, "MPCOMM_TIMEOUT")
    except ConfigError as exc:
        raise ConfigError(f"MPCOMM_TIMEOUT={value!r}: {exc}") from None


def _env_seconds(name: str, what: str) -> float:
    """The finite number of seconds >= 0 in variable ``name``, 0 where it is unset or empty."""
    parsed = _env_parsed(name, float, f"a finite number of seconds >= 0 ({what})")
    if parsed is None:
        return 0.0
    value, number = parsed
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{name}={value!r}: expected a finite number of seconds >= 0 ({what})")
    return number


def _env_flag(name: str) -> bool:
    value = (_env(name) or "").lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={os.environ[name]!r}: expected one of {', '.join(_TRUE + _FALSE[1:])}")


def _env_positive_int(name: str, what: str) -> int | None:
    return _env_int(name, what, minimum=1)


def _env_count(name: str, what: str, default: int) -> int:
    """The int >= 0 in variable ``name``, ``default`` where it is unset or empty."""
    number = _env_int(name, what, minimum=0)
    return default if number is None else number


def _env_int(name: str, what: str, minimum: int) -> int | None:
    """The int in variable ``name`` (None where it is unset or empty); ConfigError below ``minimum``."""
    parsed = _env_parsed(name, int, f"an int >= {minimum} ({what})")
    if parsed is None:
        return None
    value, number = parsed
    if number < minimum:
        raise ConfigError(f"{name}={value!r}: {what} must be >= {minimum}, got {number}")
    return number


def _env_parsed(name: str, parse: Callable[[str], T], expected: str) -> tuple[str, T] | None:
    """``(text, parse(text))`` of variable ``name``; None where it is unset or empty; ConfigError naming the
    variable where it does not parse."""
    value = _env(name)
    if not value:
        return None
    try:
        return value, parse(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected {expected}") from None


def _staging_chunk() -> int:
    from .staging import chunk_bytes  # (staging reads it again at each transfer; here the ranks compare it)

    try:
        return chunk_bytes()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    value = (_env(name) or default).lower()
    if value not in choices:
        raise ConfigError(f"{name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return value
