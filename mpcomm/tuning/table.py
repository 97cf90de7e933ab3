"""The tuning table: its format, its checks, and saving / loading it as JSON.

The table is plain JSON (its layout is described in :mod:`mpcomm.tuning.measure`). It is checked entry by entry
when it is loaded.

A table with the right ``format`` but a broken entry would otherwise load without complaint and make every later
``algorithm="auto"`` call fail with a bare ``KeyError``/``IndexError`` (or a log2 warning for a size <= 0).
:func:`check_table` names the first broken entry by its path in the JSON, e.g.
``operations.allreduce.float32.sizes[2]: must be a positive integer byte count, got 0``.
"""
from __future__ import annotations

import json
import math
import warnings
from typing import Any

import numpy as np

TABLE_FORMAT = "mpcomm-tuning/1"


def save(comm, table: dict | None, path: str) -> None:
    """Write ``table`` to ``path`` as JSON on rank 0 of ``comm``; every rank raises OSError if that failed
    (collective)."""
    if table is None:
        raise ValueError("save_tuning: there is no tuning table; run comm.tune() or comm.load_tuning() first")
    error = None
    if comm.rank == 0:
        try:
            with open(path, "w") as f:
                json.dump(table, f, indent=1)
        except OSError as exc:
            error = f"save_tuning: cannot write {path!r}: {exc}"
    error = comm.bcast_object(error, root=0, operation="save_tuning")
    if error:
        raise OSError(error)


def load(comm, path: str, missing_ok: bool = False) -> dict | None:
    """The table saved at ``path``, read on rank 0 of ``comm`` and shared (collective). A file that does not
    exist: FileNotFoundError, or with ``missing_ok`` a warning and None; an unreadable one: ValueError."""
    table, error = None, None
    if comm.rank == 0:
        try:
            with open(path) as f:
                table = json.load(f)
        except FileNotFoundError:
            error = "missing"
        except (OSError, ValueError) as exc:
            error = f"load_tuning: cannot read tuning table {path!r}: {exc}"
    table, error = comm.bcast_object((table, error), root=0, operation="load_tuning")
    if error == "missing":
        if not missing_ok:
            raise FileNotFoundError(f"load_tuning: no tuning table at {path!r}")
        warnings.warn(f"mpcomm: tuning file {path!r} does not exist; auto uses the cost model", RuntimeWarning,
                      stacklevel=3)
        return None
    if error:
        raise ValueError(error)
    return table


class _Broken(Exception):
    """One broken entry: ``where`` (a JSON path) and what is wrong with it."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")


def check_table(table: Any, source: str = "tuning table") -> None:
    """Raise ``ValueError`` naming ``source`` and the first broken entry unless ``table`` is well formed.

    Well formed: ``operations`` maps operation names to dtype names (numpy can parse) to entries, each with
    ``sizes`` (a non-empty list of positive integers), ``best`` (one algorithm name per size) and, optionally,
    ``seconds`` (per algorithm, one finite non-negative time per size) and ``fit`` (per algorithm, finite
    ``alpha`` and ``beta``). The caller checks ``format`` and ``layout`` (a mismatch there is not a broken table).
    """
    try:
        _check_operations(table)
    except _Broken as exc:
        raise ValueError(f"mpcomm: {source} is not a valid tuning table: {exc}") from None


def _check_operations(table: Any) -> None:
    operations = _mapping(table.get("operations") if isinstance(table, dict) else None, "operations")
    for operation, by_dtype in operations.items():
        for dtype, entry in _mapping(by_dtype, f"operations.{operation}").items():
            where = f"operations.{operation}.{dtype}"
            try:
                np.dtype(dtype)
            except TypeError:
                raise _Broken(where, f"{dtype!r} is not a dtype name") from None
            _check_entry(_mapping(entry, where), where)


def _check_entry(entry: dict, where: str) -> None:
    for key in ("sizes", "best"):
        if key not in entry:
            raise _Broken(where, f"missing {key!r} (has {sorted(entry)})")
    sizes = _list(entry["sizes"], f"{where}.sizes")
    if not sizes:
        raise _Broken(f"{where}.sizes", "is empty")
    for i, size in enumerate(sizes):
        if not _is_int(size) or size < 1:
            raise _Broken(f"{where}.sizes[{i}]", f"must be a positive integer byte count, got {size!r}")
    best = _list(entry["best"], f"{where}.best", len(sizes))
    for i, name in enumerate(best):
        if not isinstance(name, str) or not name:
            raise _Broken(f"{where}.best[{i}]", f"must be an algorithm name, got {name!r}")
    for algorithm, times in _mapping(entry.get("seconds", {}), f"{where}.seconds").items():
        for i, value in enumerate(_list(times, f"{where}.seconds.{algorithm}", len(sizes))):
            _number(value, f"{where}.seconds.{algorithm}[{i}]", minimum=0.0)
    for algorithm, fit in _mapping(entry.get("fit", {}), f"{where}.fit").items():
        fit = _mapping(fit, f"{where}.fit.{algorithm}")
        for key in ("alpha", "beta"):
            if key not in fit:
                raise _Broken(f"{where}.fit.{algorithm}", f"missing {key!r}")
            _number(fit[key], f"{where}.fit.{algorithm}.{key}")


def _mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _Broken(where, f"must be an object, got {_kind(value)}")
    return value


def _list(value: Any, where: str, length: int | None = None) -> list:
    if not isinstance(value, list):
        raise _Broken(where, f"must be a list, got {_kind(value)}")
    if length is not None and len(value) != length:
        raise _Broken(where, f"has {len(value)} entries, sizes has {length}")
    return value


def _number(value: Any, where: str, minimum: float = -math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < minimum:
        bound = f" >= {minimum:g}" if minimum > -math.inf else ""
        raise _Broken(where, f"must be a finite number{bound}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"[:80]
