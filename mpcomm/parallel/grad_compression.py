"""Gradient compression with error feedback for DistributedDataParallel's buckets.

Modes (``DistributedDataParallel(compression=...)``, ``mpcomm-train --compression``):

* ``None``: the exact average (``comm.iallreduce(bucket, op="avg")``).
* ``"bf16"`` / ``"fp16"`` / ``"int8"``: the bucket is all-reduced with that type on the wire
  (``comm.allreduce(..., wire=...)``, the codecs of :mod:`mpcomm.compression`); float32 gradients only.
* ``"powersgd:R"``: torch's ``powerSGD_hook`` (Vogels et al., 2019) at rank R: every gradient of >= 2 dims, seen as a
  matrix M (first dim x the rest), is sent as P = M Q (all-reduced, orthogonalized) and Q = M^T P (all-reduced,
  averaged); the rank's new gradient is P Q^T. Q is warm-started from the previous step. Vectors, and matrices
  too small for rank R to save bytes (torch's ``min_compression_rate`` 2), are averaged exactly
  (:mod:`mpcomm.parallel.powersgd`, shared with FSDP).
* ``"auto"``: per bucket and step, the wire the communicator's cost model prices cheapest
  (:func:`mpcomm.compression.pays`), else exact; on one host that is always exact.

Error feedback (as PowerSGD and 1-bit Adam do): each rank adds the error it kept at the previous step to the new
gradient before compressing, and keeps as its new error what it sent minus the compressed average that came back
(torch's PowerSGD hook's rule, for every mode). Summed over the ranks the errors are exactly p x (exact average -
compressed average) — the ranks' own distances from the average cancel — so the next step's average makes up all
this one lost, whatever the wire rounded: each rank's gradient, the node's sum, the sum's last encode. (A rank's
own rounding, x - roundtrip(x), would miss the last two: they pile up where the gradients keep their sign.)
Warm-up: the first ``warmup_steps`` synchronizing steps are exact (and leave no error).
The state (step count, per-rank errors, PowerSGD's Q) is :meth:`GradCompressor.state_dict`: per parameter name,
so it survives bucket rebuilds and loads under any bucketing; :func:`merge_states` reshards it to another world size.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..comm import Communicator
from ..compression import WIRES
from ..errors import ConfigError
from ..nn.backend import array_module, to_numpy
from ..work import Work
from .powersgd import matrix_dims, orthogonalize, reduce_powersgd

if TYPE_CHECKING:  # pragma: no cover
    from .ddp import Bucket

__all__ = ["CompressionSpec", "parse_compression", "GradCompressor", "merge_states", "DEFAULT_WARMUP_STEPS",
           "WIRES", "cheapest_wire", "feed_back", "orthogonalize"]

AUTO_WIRES = ("bf16", "int8")  # fp16 is left out: gradients past 65504 would become inf
DEFAULT_WARMUP_STEPS = 10  # exact steps first: early gradients are large and change fast (torch's hook: 1000)
_POWERSGD = re.compile(r"powersgd:(\d+)")
_CHOICES = "None, 'bf16', 'fp16', 'int8', 'powersgd:RANK' (RANK >= 1) or 'auto'"


@dataclass(frozen=True)
class CompressionSpec:
    """A parsed ``compression=`` value: ``mode`` is a wire name, ``"powersgd"`` or ``"auto"``."""

    mode: str
    rank: int = 0
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    error_feedback: bool = True

    @property
    def name(self) -> str:
        return f"powersgd:{self.rank}" if self.mode == "powersgd" else self.mode


def parse_compression(value: Any, warmup_steps: Any = DEFAULT_WARMUP_STEPS,
                      error_feedback: bool = True) -> CompressionSpec | None:
    """``None`` for no compression, else the spec; ConfigError naming the value for anything else."""
    if value is None:
        return None
    if (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, (int, np.integer))
            or warmup_steps < 0):
        raise ConfigError(f"compression warm-up must be a whole number of steps >= 0, got {warmup_steps!r}")
    if isinstance(value, str) and (value in WIRES or value == "auto"):
        return CompressionSpec(value, 0, int(warmup_steps), bool(error_feedback))
    match = _POWERSGD.fullmatch(value) if isinstance(value, str) else None
    if match and int(match.group(1)) >= 1:
        return CompressionSpec("powersgd", int(match.group(1)), int(warmup_steps), bool(error_feedback))
    raise ConfigError(f"compression must be {_CHOICES}; got {value!r}")


Launch = tuple[Work, Callable[[], None] | None]


class GradCompressor:
    """One engine's compression: which buckets to compress how, and the state that carries between steps."""

    def __init__(self, spec: CompressionSpec, comm: Communicator, names: Sequence[str], shapes: Sequence[tuple],
                 dtypes: Sequence[Any]):
        if spec.mode in WIRES or spec.mode == "auto":
            wrong = sorted({f"{n} ({np.dtype(d)})" for n, d in zip(names, dtypes) if np.dtype(d) != np.float32})
            if wrong:
                raise ConfigError(f"compression={spec.name!r} compresses float32 gradients; parameter(s) "
                                  f"{', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''} are not float32 "
                                  "(use powersgd:RANK, or a float32 model)")
        self.spec, self.comm = spec, comm
        self.names, self.shapes = list(names), [tuple(s) for s in shapes]
        self.steps = 0                      # synchronizing steps finished
        self.errors: dict[int, Any] = {}    # bucket index -> flat error of its gradients (this rank's)
        self.q: dict[int, Any] = {}         # parameter index -> PowerSGD's Q (m x r), warm start
        self.last_choice: dict[int, str] = {}  # bucket index -> what the last step did ("exact" or a mode)

    # -- per step ------------------------------------------------------------------------------
    @property
    def warming_up(self) -> bool:
        return self.steps < self.spec.warmup_steps

    def launch(self, bucket: "Bucket") -> Launch:
        """Start reducing ``bucket`` (its gradients, then its unused-parameter tail exactly)."""
        mode = self._choose(bucket)
        self.last_choice[bucket.index] = mode
        if mode == "exact":
            self._flush_error(bucket)
            return self.comm.iallreduce(bucket.buffer, op="avg"), None
        if mode == "powersgd":
            return self._launch_powersgd(bucket)
        return self._launch_wire(bucket, mode)

    def finish_step(self) -> None:
        """A synchronizing backward completed (every bucket's ``finish`` ran)."""
        self.steps += 1

    def _choose(self, bucket: "Bucket") -> str:
        if self.warming_up:
            return "exact"
        if self.spec.mode != "auto":
            return self.spec.mode
        return cheapest_wire(self.comm, bucket.numel) or "exact"

    # -- error feedback --------------------------------------------------------------------------
    def _feedback(self, bucket: "Bucket") -> Callable[[], None]:
        """Add last step's error to the bucket's gradients; returns what keeps this step's error (:func:`feed_back`)."""
        if not self.spec.error_feedback:
            return _nothing
        return feed_back(self.errors, bucket.index, bucket.buffer[: bucket.numel])

    def _flush_error(self, bucket: "Bucket") -> None:
        """An exact step sends any error left over (auto switched off): nothing remains to carry."""
        error = self.errors.pop(bucket.index, None)
        if error is not None:
            bucket.buffer[: bucket.numel] += error

    # -- wires (mpcomm.compression) ----------------------------------------------------------------
    def _launch_wire(self, bucket: "Bucket", wire: str) -> Launch:
        keep_error = self._feedback(bucket)
        tail_work = self.comm.iallreduce(bucket.tail, op="avg") if bucket.tail.size else None
        work = self.comm.iallreduce(bucket.buffer[: bucket.numel], op="avg", wire=wire)

        def finish() -> None:
            if tail_work is not None:
                tail_work.wait()
            keep_error()

        return work, finish

    # -- PowerSGD (mpcomm.parallel.powersgd) --------------------------------------------------------
    def _matrix(self, i: int) -> tuple[int, int, int] | None:
        return matrix_dims(self.shapes[i], self.spec.rank)

    def _launch_powersgd(self, bucket: "Bucket") -> Launch:
        keep_error = self._feedback(bucket)
        work, reduced = reduce_powersgd(self.comm, [(i, i, bucket.views[i]) for i in bucket.members],
                                        self.spec.rank, self.q, extra=[bucket.tail])

        def finish() -> None:
            reduced()
            keep_error()

        return work, finish

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self, buckets: Sequence["Bucket"]) -> dict:
        """This rank's state: ``{"mode", "steps", "error": {name: array}, "powersgd_q": {name: array}}`` (host
        copies; only parameters with an error / a Q appear)."""
        error = {}
        for b in buckets:
            flat = self.errors.get(b.index)
            if flat is not None:
                for i, (o, n) in b.offsets.items():
                    error[self.names[i]] = to_numpy(flat[o: o + n]).reshape(self.shapes[i]).copy()
        return {"mode": self.spec.name, "steps": self.steps, "error": error,
                "powersgd_q": {self.names[i]: to_numpy(q).copy() for i, q in sorted(self.q.items())}}

    def load_state_dict(self, state: dict, buckets: Sequence["Bucket"]) -> None:
        """Take ``state`` (from :meth:`state_dict` or :func:`merge_states`), checked against this model first."""
        index = {n: i for i, n in enumerate(self.names)}
        if state.get("mode") != self.spec.name:
            raise ConfigError(f"compression state was saved with compression={state.get('mode')!r}, this engine "
                              f"uses {self.spec.name!r}")
        for key in ("error", "powersgd_q"):
            unknown = sorted(set(state.get(key, {})) - set(index))
            if unknown:
                raise ConfigError(f"compression state {key!r} names parameters this model lacks: {unknown[:5]}")
        for name, q in state.get("powersgd_q", {}).items():
            dims = self._matrix(index[name])
            if dims is None or tuple(q.shape) != (dims[1], dims[2]):
                raise ConfigError(f"compression state: PowerSGD Q of {name!r} has shape {tuple(q.shape)}, this "
                                  f"model expects {None if dims is None else (dims[1], dims[2])}")
        for name, e in state.get("error", {}).items():
            if tuple(e.shape) != self.shapes[index[name]]:
                raise ConfigError(f"compression state: error of {name!r} has shape {tuple(e.shape)}, the "
                                  f"parameter has {self.shapes[index[name]]}")
        errors = state.get("error", {})
        self.errors = {}
        for b in buckets:
            if any(self.names[i] in errors for i in b.members):
                xp = array_module(b.buffer)
                flat = self.errors[b.index] = xp.zeros(b.numel, dtype=b.dtype)
                for i, (o, n) in b.offsets.items():
                    if self.names[i] in errors:
                        flat[o: o + n] = xp.asarray(np.asarray(errors[self.names[i]]).reshape(-1))
        xp_of = {i: array_module(b.buffer) for b in buckets for i in b.members}
        self.q = {index[n]: xp_of[index[n]].asarray(np.array(q, dtype=self._dtype_of(buckets, index[n])))
                  for n, q in state.get("powersgd_q", {}).items()}
        self.steps = int(state["steps"])

    @staticmethod
    def _dtype_of(buckets: Sequence["Bucket"], i: int) -> Any:
        return next(b.dtype for b in buckets if i in b.offsets)


def merge_states(states: Sequence[dict]) -> dict:
    """One state from every old rank's (for any new world size): the errors averaged — what the averaged gradient
    still owes is (1/p) sum of the ranks' errors, so each new rank carries that mean — Q and steps as they are
    (identical on every rank)."""
    if not states:
        raise ValueError("merge_states needs the state of at least one rank")
    first = states[0]
    for s in states[1:]:
        if s["mode"] != first["mode"] or s["steps"] != first["steps"] or set(s["error"]) != set(first["error"]):
            raise ValueError("merge_states: the ranks' states disagree on mode, steps or parameters")
    error = {n: np.mean([np.asarray(s["error"][n], dtype=np.float64) for s in states], axis=0)
             for n in first["error"]}
    return {"mode": first["mode"], "steps": first["steps"],
            "error": {n: e.astype(np.asarray(first["error"][n]).dtype) for n, e in error.items()},
            "powersgd_q": dict(first["powersgd_q"])}


def feed_back(errors: dict, key: Any, grads: Any) -> Callable[[], None]:
    """Add the error kept under ``key`` to ``grads`` (in place); returns what keeps, once ``grads`` holds the reduced
    result, the new error: what was sent minus what came back (torch's PowerSGD rule)."""
    error = errors.get(key)
    if error is None:
        error = errors[key] = grads.copy()
    else:
        error += grads  # the error's buffer holds what is sent until the result is back: no allocation per step
        grads[...] = error

    def keep() -> None:
        error[...] -= grads

    return keep


def _nothing() -> None:
    """No error to keep."""


def cheapest_wire(comm: Communicator, numel: int) -> str | None:
    """Of the wires ``auto`` may use, the one the communicator's cost model prices cheapest for a float32 all-reduce
    of ``numel`` elements among those it says pay (``Selector.wire_pays``: one host never), or None (exact)."""
    nbytes = 4 * numel
    paying = [w for w in AUTO_WIRES if comm.selector.wire_pays(w, nbytes)]
    return min(paying, key=lambda w: comm.selector.price_wire(w, nbytes)[0]) if paying else None
