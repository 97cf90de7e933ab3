"""Gradient compression with error feedback for FullyShardedDataParallel's reduce-scatter.

``FullyShardedDataParallel(compression="bf16"|"fp16"|"int8"|"auto", compression_warmup_steps=10,
error_feedback=True)``: each unit's flat float32 gradient is reduce-scattered with that type on the wire
(``comm.ireduce_scatter(grad, shard_grad, op="avg", wire=...)``: every rank's chunk j goes through the codec once
and rank j adds the decoded chunks in float32; ``mpcomm/algorithms/compressed.py``). ``"auto"`` picks, per unit and
step, the wire the communicator's cost model prices cheapest among those it says pay (DDP's rule,
:func:`~mpcomm.parallel.grad_compression.cheapest_wire`, on the unit's gradient bytes: the model prices all-reduces,
and a reduce-scatter is the first half of one, the same bytes saved in the same ratio); on one host none pays, so it
is the exact reduce-scatter.

Error feedback, rank-local: the rank adds the error it kept to its new unsharded gradient, sends compress(g + e)
and keeps e = (g + e) - roundtrip(g + e), roundtrip taken chunk by chunk as the wire encodes them. For the
compressed reduce-scatter that is exactly what the wire took from this rank (nothing else is rounded: the sum stays
float32 on its rank), so summed over ranks the errors are what the averaged gradient still owes — DDP's global rule
(what was sent minus the average that came back) is not available anyway: each rank gets back only its own shard of
the average. Cost: one float32 error buffer the size of each unit's unsharded (padded) gradient on every rank,
kept between steps — as much as the gathered parameters of the whole model (``memory_stats()``'s
``compression_error_bytes``), the price of error feedback on a sharded engine; ``error_feedback=False`` keeps none.
Warm-up: the first ``warmup_steps`` backward passes are exact and leave no error.

PowerSGD is not offered: its P = M Q and Q = M^T P all-reduces need every rank's whole gradient matrix, while FSDP
reduces each unit's flat gradient to shards (a low-rank reduce-scatter does not exist: each shard's rows of P Q^T
need all of Q). Strategies: full_shard and shard_grad_op (the reduce-scatter over all ranks); no_shard and
hybrid_shard reduce by all-reduce across replicas, not offered here (DDP compresses no_shard's case).

State: :meth:`ShardedCompressor.state_dict` (steps, this rank's error per unit, unpadded) goes into the sharded
checkpoint (``fsdp_checkpoint``); a load at the same world size takes each rank's own error back (the resumed run
continues bitwise), at another world size each rank takes the mean of the saved ranks' errors (what the average
still owes, as DDP's :func:`~mpcomm.parallel.grad_compression.merge_states`).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..comm import Communicator
from ..compression import Codec, codec
from ..errors import ConfigError
from ..work import Work
from .grad_compression import CompressionSpec, cheapest_wire

__all__ = ["ShardedCompressor", "check_compression"]


def check_compression(spec: CompressionSpec, strategy: str) -> None:
    """NotImplementedError for what FSDP does not compress (before anything is built: the same on every rank)."""
    if spec.mode == "powersgd":
        raise NotImplementedError(
            f"FullyShardedDataParallel(compression={spec.name!r}): PowerSGD is not implemented for FSDP: its P and "
            "Q all-reduces need each rank's whole gradient matrix, and FSDP reduce-scatters every unit's flat "
            "gradient into shards; use 'bf16', 'fp16', 'int8' or 'auto', or DistributedDataParallel for PowerSGD")
    if strategy not in ("full_shard", "shard_grad_op"):
        raise NotImplementedError(
            f"FullyShardedDataParallel(compression={spec.name!r}) compresses the gradient reduce-scatter of "
            f"full_shard and shard_grad_op; sharding_strategy {strategy!r} reduces by all-reduce across replicas, "
            "which is not compressed here (DistributedDataParallel(compression=...) covers no_shard's case)")


class ShardedCompressor:
    """One FSDP engine's compression: per unit, which wire to use and the error this rank keeps."""

    def __init__(self, spec: CompressionSpec, comm: Communicator, units: Sequence[Any]):
        wrong = [f"{u.name or '<root>'} ({np.dtype(u.reduce_dtype)}, {u.xp.__name__})" for u in units
                 if np.dtype(u.reduce_dtype) != np.float32 or u.xp is not np]
        if wrong:
            raise ConfigError(f"FullyShardedDataParallel(compression={spec.name!r}) compresses float32 gradients in "
                              f"host numpy arrays (the codecs'); unit(s) {', '.join(wrong[:3])} reduce otherwise "
                              "(use a float32 numpy model, or MixedPrecision(reduce_dtype=float32))")
        self.spec, self.comm = spec, comm
        self.steps = 0                            # backward passes finished
        self.errors: dict[str, np.ndarray] = {}   # unit name -> this rank's error (the unit's padded gradient size)
        self.last_choice: dict[str, str] = {}     # unit name -> what its last reduction did ("exact" or a wire)

    @property
    def warming_up(self) -> bool:
        return self.steps < self.spec.warmup_steps

    def error_bytes(self) -> int:
        return sum(int(e.nbytes) for e in self.errors.values())

    def reduce_scatter(self, name: str, grad: np.ndarray, out: np.ndarray) -> Work:
        """Start averaging unit ``name``'s flat gradient ``grad`` (this rank's own buffer: it is changed) into its
        shard ``out``, compressed unless warming up or ``auto`` finds no wire that pays."""
        wire = self._choose(grad.size)
        self.last_choice[name] = wire or "exact"
        error = self.errors.get(name)
        if error is not None:  # what the wire took last time is sent now, compressed or exact
            grad += error
        if wire is None:
            self.errors.pop(name, None)  # an exact step (auto switched off) leaves nothing to carry
            return self.comm.ireduce_scatter(grad, out, op="avg")
        work = self.comm.ireduce_scatter(grad, out, op="avg", wire=wire)
        if self.spec.error_feedback:  # (reads grad beside the reduce-scatter, which only reads it too)
            self.errors[name] = lost_on_the_wire(codec(wire), grad, out.size, error)
        return work

    def finish_step(self) -> None:
        """A backward pass finished (every unit's reduction started)."""
        self.steps += 1

    def _choose(self, numel: int) -> str | None:
        if self.warming_up:
            return None
        if self.spec.mode == "auto":
            return cheapest_wire(self.comm, numel)
        return self.spec.mode

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self, units: Sequence[Any]) -> dict:
        """``{"mode", "steps", "error": {unit name: this rank's error without the padding}}`` (host copies)."""
        return {"mode": self.spec.name, "steps": self.steps,
                "error": {u.name: self.errors[u.name][: u.layout.numel].copy() for u in units if u.name in self.errors}}

    def load_state_dict(self, state: dict, units: Sequence[Any]) -> None:
        """Take ``state`` (as :meth:`state_dict` gives it; errors of any padding), checked against the units first."""
        if state.get("mode") != self.spec.name:
            raise ConfigError(f"compression state was saved with compression={state.get('mode')!r}, this engine "
                              f"uses {self.spec.name!r}")
        by_name = {u.name: u for u in units}
        for name, e in state["error"].items():
            if name not in by_name:
                raise ConfigError(f"compression state: an error of unit {name!r}, which this engine lacks (its "
                                  f"units: {sorted(by_name)})")
            if np.shape(e) != (by_name[name].layout.numel,):
                raise ConfigError(f"compression state: error of unit {name!r} has shape {np.shape(e)}, the unit's "
                                  f"gradient ({by_name[name].layout.numel},)")
        errors = {}
        for name, e in state["error"].items():
            errors[name] = np.zeros(by_name[name].layout.padded_numel, dtype=np.float32)  # padding: no error
            errors[name][: np.size(e)] = e
        self.errors, self.steps = errors, int(state["steps"])


def lost_on_the_wire(wire: Codec, sent: np.ndarray, chunk: int, into: np.ndarray | None = None) -> np.ndarray:
    """``sent - roundtrip(sent)`` with the roundtrip taken chunk by chunk (``chunk`` elements each), as the compressed
    reduce-scatter encodes them: what the wire takes from this rank (written into ``into`` when given)."""
    out = np.empty_like(sent) if into is None else into
    for lo in range(0, sent.size, max(chunk, 1)):
        piece = sent[lo: lo + chunk]
        np.subtract(piece, wire.roundtrip(piece), out=out[lo: lo + chunk])
    return out
