"""Gradient compression with error feedback for FullyShardedDataParallel's reduce-scatter.

``FullyShardedDataParallel(compression="bf16"|"fp16"|"int8"|"powersgd:R"|"auto", compression_warmup_steps=10,
error_feedback=True)``.

Wires (``"bf16"``, ``"fp16"``, ``"int8"``): each unit's flat float32 gradient is reduce-scattered with that type on
the wire (``comm.ireduce_scatter(grad, shard_grad, op="avg", wire=...)``: every rank's chunk j goes through the codec
once and rank j adds the decoded chunks in float32; ``mpcomm/algorithms/compressed.py``). ``"auto"`` picks, per unit
and step, the wire the communicator's cost model prices cheapest among those it says pay (DDP's rule,
:func:`~mpcomm.parallel.grad_compression.cheapest_wire`, on the unit's gradient bytes: the model prices all-reduces,
and a reduce-scatter is the first half of one, the same bytes saved in the same ratio); on one host none pays, so it
is the exact reduce-scatter. Like DDP's ``auto`` it never picks PowerSGD.

Wire error feedback, rank-local: the rank adds the error it kept to its new unsharded gradient, sends
compress(g + e) and keeps e = (g + e) - roundtrip(g + e), roundtrip taken chunk by chunk as the wire encodes them.
For the compressed reduce-scatter that is exactly what the wire took from this rank (nothing else is rounded: the
sum stays float32 on its rank), so summed over ranks the errors are what the averaged gradient still owes — DDP's
global rule (what was sent minus the average that came back) is not available: each rank gets back only its shard.

PowerSGD (``"powersgd:R"``, float32 or float64): a reduce-scatter cannot carry it (each shard's rows of P Q^T need
all of Q), so a unit holding a matrix rank R compresses is reduced as a DDP bucket is
(:func:`~mpcomm.parallel.powersgd.reduce_powersgd`: P and Q all-reduced over the ranks, the unit's vectors and small
matrices averaged exactly in P's all-reduce) and the rank keeps its shard of the averaged result — the shard the
reduce-scatter would have given. A unit with no such matrix takes the exact reduce-scatter (and keeps no error).
Its error feedback is DDP's rule, available here because every rank has the whole average: e = (g + e) - result.
The Q of each matrix (m x R, the same on every rank) is kept and warm-starts the next step.

Cost: one error buffer the size of each unit's unsharded (padded) gradient on every rank, kept between steps — as
much as the gathered parameters of the whole model (``memory_stats()``'s ``compression_error_bytes``), the price of
error feedback on a sharded engine; ``error_feedback=False`` keeps none. PowerSGD's Qs add
``compression_q_bytes``. Warm-up: the first ``warmup_steps`` backward passes are exact and leave no error.
Strategies: full_shard and shard_grad_op (the reduce-scatter over all ranks); no_shard and hybrid_shard reduce by
all-reduce across replicas, not offered here (DDP compresses no_shard's case).

State: :meth:`ShardedCompressor.state_dict` (steps, this rank's error per unit, unpadded, and PowerSGD's Q per
parameter name) goes into the sharded checkpoint (``fsdp_checkpoint``); a load at the same world size takes each
rank's own error back (the resumed run continues bitwise), at another world size each rank takes the mean of the
saved ranks' errors (what the average still owes, as DDP's :func:`~mpcomm.parallel.grad_compression.merge_states`)
and the shared Q as it is.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..comm import Communicator
from ..compression import Codec, codec
from ..errors import ConfigError
from .grad_compression import CompressionSpec, Launch, cheapest_wire, feed_back
from .powersgd import matrix_dims, reduce_powersgd

__all__ = ["ShardedCompressor", "check_compression", "pack_q", "q_numel", "unpack_q"]

POWERSGD_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_compression(spec: CompressionSpec, strategy: str) -> None:
    """NotImplementedError for what FSDP does not compress (before anything is built: the same on every rank)."""
    if strategy not in ("full_shard", "shard_grad_op"):
        raise NotImplementedError(
            f"FullyShardedDataParallel(compression={spec.name!r}) compresses the gradient reduction of "
            f"full_shard and shard_grad_op; sharding_strategy {strategy!r} reduces by all-reduce across replicas, "
            "which is not compressed here (DistributedDataParallel(compression=...) covers no_shard's case)")


class ShardedCompressor:
    """One FSDP engine's compression: per unit, how to reduce it and the state this rank keeps between steps.

    ``seeds``: each parameter's index in the model (PowerSGD's first Q is seeded by it, as DDP's is)."""

    def __init__(self, spec: CompressionSpec, comm: Communicator, units: Sequence[Any], seeds: dict[str, int]):
        if spec.mode == "powersgd":
            wrong = [f"{u.name or '<root>'} ({np.dtype(u.reduce_dtype)}, {u.xp.__name__})" for u in units
                     if np.dtype(u.reduce_dtype) not in POWERSGD_DTYPES or u.xp is not np]
            needs = "float32 or float64 gradients in host numpy arrays"
        else:
            wrong = [f"{u.name or '<root>'} ({np.dtype(u.reduce_dtype)}, {u.xp.__name__})" for u in units
                     if np.dtype(u.reduce_dtype) != np.float32 or u.xp is not np]
            needs = "float32 gradients in host numpy arrays (the codecs')"
        if wrong:
            raise ConfigError(f"FullyShardedDataParallel(compression={spec.name!r}) compresses {needs}; unit(s) "
                              f"{', '.join(wrong[:3])} reduce otherwise (use a float32 numpy model, or "
                              "MixedPrecision(reduce_dtype=float32))")
        self.spec, self.comm, self.seeds = spec, comm, dict(seeds)
        self.steps = 0                            # backward passes finished
        self.errors: dict[str, np.ndarray] = {}   # unit name -> this rank's error (the unit's padded gradient size)
        self.q: dict[str, np.ndarray] = {}        # parameter name -> PowerSGD's Q (m x r), warm start
        self.last_choice: dict[str, str] = {}     # unit name -> what its last reduction did ("exact" or a mode)
        self.compressible = {u.name for u in units if spec.mode == "powersgd"
                             and any(matrix_dims(i.shape, spec.rank) for i in u.layout.params)}

    @property
    def warming_up(self) -> bool:
        return self.steps < self.spec.warmup_steps

    def error_bytes(self) -> int:
        return sum(int(e.nbytes) for e in self.errors.values())

    def q_bytes(self) -> int:
        return sum(int(q.nbytes) for q in self.q.values())

    def reduce_scatter(self, unit: Any, grad: np.ndarray, out: np.ndarray) -> Launch:
        """Start averaging ``unit``'s flat gradient ``grad`` (this rank's own buffer: it is changed) into its shard
        ``out``, compressed unless warming up, ``auto`` finds no wire that pays or PowerSGD no matrix to compress.
        Returns the Work and what completes ``out`` after it (or None)."""
        mode = self._choose(unit.name, grad.size)
        self.last_choice[unit.name] = mode
        if mode == "powersgd":
            return self._reduce_powersgd(unit, grad, out)
        error = self.errors.get(unit.name)
        if error is not None:  # what the wire took last time is sent now, compressed or exact
            grad += error
        if mode == "exact":
            self.errors.pop(unit.name, None)  # an exact step (auto switched off) leaves nothing to carry
            return self.comm.ireduce_scatter(grad, out, op="avg"), None
        work = self.comm.ireduce_scatter(grad, out, op="avg", wire=mode)
        if self.spec.error_feedback:  # (reads grad beside the reduce-scatter, which only reads it too)
            self.errors[unit.name] = lost_on_the_wire(codec(mode), grad, out.size, error)
        return work, None

    def _reduce_powersgd(self, unit: Any, grad: np.ndarray, out: np.ndarray) -> Launch:
        keep_error = feed_back(self.errors, unit.name, grad) if self.spec.error_feedback else None
        grads = [(info.name, self.seeds[info.name], view)
                 for info, view in zip(unit.layout.params, unit.layout.views(grad))]
        work, reduced = reduce_powersgd(self.comm, grads, self.spec.rank, self.q)  # (the padding stays zero)
        lo, hi = unit.layout.shard_range(unit.groups.shard_index)

        def finish() -> None:
            reduced()
            if keep_error is not None:
                keep_error()
            out[...] = grad[lo:hi]

        return work, finish

    def finish_step(self) -> None:
        """A backward pass finished (every unit's reduction started)."""
        self.steps += 1

    def _choose(self, name: str, numel: int) -> str:
        if self.warming_up:
            return "exact"
        if self.spec.mode == "auto":
            return cheapest_wire(self.comm, numel) or "exact"
        if self.spec.mode == "powersgd":
            return "powersgd" if name in self.compressible else "exact"
        return self.spec.mode

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self, units: Sequence[Any]) -> dict:
        """``{"mode", "steps", "error": {unit name: this rank's error without the padding}, "powersgd_q": {parameter
        name: Q}}`` (host copies)."""
        return {"mode": self.spec.name, "steps": self.steps,
                "error": {u.name: self.errors[u.name][: u.layout.numel].copy() for u in units if u.name in self.errors},
                "powersgd_q": {n: q.copy() for n, q in self.q.items()}}

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
        q_shapes = {i.name: (dims[1], dims[2], u.reduce_dtype) for u in units for i in u.layout.params
                    if self.spec.mode == "powersgd" and (dims := matrix_dims(i.shape, self.spec.rank))}
        for name, q in state.get("powersgd_q", {}).items():
            if name not in q_shapes or np.shape(q) != q_shapes[name][:2]:
                raise ConfigError(f"compression state: PowerSGD Q of {name!r} has shape {np.shape(q)}, this engine "
                                  f"expects {q_shapes[name][:2] if name in q_shapes else 'none (no such matrix)'}")
        errors = {}
        for name, e in state["error"].items():
            u = by_name[name]
            errors[name] = np.zeros(u.layout.padded_numel, dtype=u.reduce_dtype)  # padding: no error
            errors[name][: np.size(e)] = e
        self.q = {n: np.array(q, dtype=q_shapes[n][2]) for n, q in state.get("powersgd_q", {}).items()}
        self.errors, self.steps = errors, int(state["steps"])


def pack_q(unit: Any, q: dict[str, np.ndarray]) -> np.ndarray | None:
    """The unit's PowerSGD Qs in layout order as one flat array (for a checkpoint file), or None if it has none."""
    mine = [q[i.name].reshape(-1) for i in unit.layout.params if i.name in q]
    return np.concatenate(mine) if mine else None


def _q_shapes(unit: Any, rank: int) -> list[tuple[str, int, int]]:
    return [(i.name, dims[1], dims[2]) for i in unit.layout.params if (dims := matrix_dims(i.shape, rank))]


def q_numel(unit: Any, rank: int) -> int:
    """Elements of the unit's PowerSGD Qs at ``rank`` together."""
    return sum(m * r for _, m, r in _q_shapes(unit, rank))


def unpack_q(unit: Any, flat: np.ndarray, rank: int) -> dict[str, np.ndarray]:
    """:func:`pack_q`'s inverse for PowerSGD at ``rank``; ValueError if ``flat`` is not :func:`q_numel` elements."""
    if flat.shape != (q_numel(unit, rank),):
        raise ValueError(f"unpack_q: {flat.shape} for unit {unit.name!r}'s Qs, ({q_numel(unit, rank)},) expected")
    out, at = {}, 0
    for name, m, r in _q_shapes(unit, rank):
        out[name] = flat[at: at + m * r].reshape(m, r).copy()
        at += m * r
    return out


def lost_on_the_wire(wire: Codec, sent: np.ndarray, chunk: int, into: np.ndarray | None = None) -> np.ndarray:
    """``sent - roundtrip(sent)`` with the roundtrip taken chunk by chunk (``chunk`` elements each), as the compressed
    reduce-scatter encodes them: what the wire takes from this rank (written into ``into`` when given)."""
    out = np.empty_like(sent) if into is None else into
    for lo in range(0, sent.size, max(chunk, 1)):
        piece = sent[lo: lo + chunk]
        np.subtract(piece, wire.roundtrip(piece), out=out[lo: lo + chunk])
    return out
