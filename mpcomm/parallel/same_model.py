"""The data-parallel engines' same-model check: every rank must hold the same parameters before training, else
one ConfigError, the same on every rank, says how they differ."""
from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np

from ..comm import Communicator
from ..errors import ConfigError

__all__ = ["check_same_model", "allgather_json"]


def check_same_model(comm: Communicator, engine: str, description: Any,
                     differences: Callable[[list[Any]], str]) -> None:
    """All-gather every rank's JSON-able ``description`` of its model; where any differs from rank 0's, raise
    ConfigError on every rank with ``differences(descriptions in rank order)``."""
    everyone = allgather_json(comm, description)
    if all(d == everyone[0] for d in everyone):
        return
    raise ConfigError(f"{engine}: the model differs across ranks (compared with rank 0) — {differences(everyone)}")


def allgather_json(comm: Communicator, obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order, through its JSON text (two all-gathers: lengths, then texts)."""
    mine = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    lengths = np.empty(comm.size, dtype=np.int64)
    comm.all_gather(np.array([mine.size], dtype=np.int64), lengths)
    width = int(lengths.max())
    padded = np.zeros(width, dtype=np.uint8)
    padded[: mine.size] = mine
    everyone = np.empty((comm.size, width), dtype=np.uint8)
    comm.all_gather(padded, everyone)
    return [json.loads(bytes(everyone[r, : lengths[r]]).decode()) for r in range(comm.size)]
