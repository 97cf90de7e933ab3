"""FullyShardedDataParallel: shard each unit's flat parameter over the data-parallel ranks (ZeRO-3 style).

    engine = FullyShardedDataParallel(model, comm, sharding_strategy="full_shard",
                                      auto_wrap_policy={TransformerMLPBlock})
    opt = Adam(engine.parameters(), lr=1e-3)          # the flat shards: the optimizer only sees 1/p
    y, ctx = engine.forward(x_local)
    loss, gy = mse_loss(y, y_local)                    # mean over this rank's part of the batch
    engine.backward(gy, ctx)                           # sharded grads are final (averaged) on return
    opt.step(); engine.zero_grad()

The pieces: ``flat_param`` (layout arithmetic, pure), ``wrap`` (which modules are units, pure),
``fsdp_unit`` (one unit's buffers and collectives), ``fsdp_schedule`` (hooks: when to gather, free, reduce,
prefetch) and ``fsdp_checkpoint`` (sharded and full checkpoints). This file wires them together.
All communication goes through the ``Communicator``.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
from mpi4py import MPI

from ..buffers import BFLOAT16
from ..comm import Communicator
from ..errors import ConfigError
from ..nn import Module, Optimizer, Parameter
from ..nn.backend import array_module, to_numpy
from . import fsdp_checkpoint
from .fsdp_checkpoint import check_optimizer
from .flat_param import FlatLayout
from .fsdp_compression import ShardedCompressor, check_compression
from .grad_compression import DEFAULT_WARMUP_STEPS, parse_compression
from .fsdp_schedule import Schedule
from .fsdp_unit import FlatUnit, Groups, MemoryTracker, placeholder
from .same_model import check_same_model
from .wrap import (CallablePolicy, ModuleTypePolicy, NoWrapPolicy, SizeBasedPolicy, UnitPlan, WrapPolicy,
                   as_policy, plan_units, size_based_auto_wrap_policy)

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "MixedPrecision", "BackwardPrefetch",
           "WrapPolicy", "SizeBasedPolicy", "ModuleTypePolicy", "CallablePolicy", "NoWrapPolicy",
           "size_based_auto_wrap_policy"]

_FLOAT_DTYPES = {np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64)}


class ShardingStrategy(str, Enum):
    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"


class BackwardPrefetch(str, Enum):
    BACKWARD_PRE = "pre"
    BACKWARD_POST = "post"


def _float_dtype(value: Any, what: str) -> np.dtype | None:
    if value is None:
        return None
    dtype = np.dtype(value)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"MixedPrecision.{what} must be float16, bfloat16, float32 or float64, got {dtype}")
    return dtype


@dataclass(frozen=True)
class MixedPrecision:
    """Compute with parameters cast to ``param_dtype``, reduce gradients in ``reduce_dtype`` (default: the
    param dtype), keep the sharded master copy (what the optimizer updates) in the model's own dtype.

    ``buffer_dtype`` is validated and kept for API parity, but has no effect: ``mpcomm.nn`` modules have no
    buffers (no running statistics), only Parameters.
    """

    param_dtype: Any = None
    reduce_dtype: Any = None
    buffer_dtype: Any = None

    def __post_init__(self):
        for what in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            object.__setattr__(self, what, _float_dtype(getattr(self, what), what))


def _is_float(a: Any) -> bool:
    return hasattr(a, "dtype") and np.dtype(a.dtype) in _FLOAT_DTYPES


class FullyShardedDataParallel:
    """Engine protocol: ``forward(x) -> (y, ctx)``, ``backward(grad_y, ctx) -> grad_x``, ``parameters()``,
    ``zero_grad()``, ``full_state_dict()``, ``module``.

    sharding_strategy: ``"full_shard"`` | ``"shard_grad_op"`` | ``"no_shard"`` | ``"hybrid_shard"`` (shard
        inside a node — ``comm.ranks_per_node`` or the shared-memory node — replicate across nodes).
    auto_wrap_policy: None (one unit), an int / ``size_based_auto_wrap_policy(n)`` (min_num_params), a set of
        Module classes, a callable(module) -> bool, or a ``WrapPolicy``.
    backward_prefetch: ``"pre"`` | ``"post"`` | None; ``forward_prefetch``: prefetch the next unit in forward.
    limit_all_gathers: at most two prefetching all-gathers in flight.
    cpu_offload: with CuPy parameters, keep the shard (and its grad and optimizer state) in host numpy and
        copy it to the device to gather. With numpy parameters there is no device: it is a no-op
        (``self.cpu_offload_active`` is False).
    sync_module_states: broadcast rank 0's parameters before sharding (so every rank starts identical).
    compression: None, ``"bf16"``, ``"fp16"``, ``"int8"``, ``"powersgd:R"`` or ``"auto"``: the gradient reduction
        sent compressed, with error feedback (:mod:`mpcomm.parallel.fsdp_compression`: numpy gradients, float32 for
        the wires, float32/float64 for PowerSGD; full_shard / shard_grad_op; the other strategies raise
        NotImplementedError, a bad name ConfigError as in DDP). Error feedback keeps, on every rank, one buffer the
        size of each unit's unsharded gradient.
    compression_warmup_steps: exact backward passes before compression starts (default 10).
    error_feedback: carry each rank's compression error into its next step's gradient (default True).
    """

    def __init__(self, module: Module, comm: Communicator, sharding_strategy: str = "full_shard",
                 auto_wrap_policy: Any = None, mixed_precision: MixedPrecision | None = None,
                 backward_prefetch: str | None = "pre", forward_prefetch: bool = False,
                 limit_all_gathers: bool = True, cpu_offload: bool = False, sync_module_states: bool = True,
                 compression: str | None = None, compression_warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 error_feedback: bool = True):
        spec = parse_compression(compression, compression_warmup_steps, error_feedback)
        if not isinstance(module, Module):
            raise TypeError(f"FullyShardedDataParallel wraps an mpcomm.nn.Module, got {type(module).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"FullyShardedDataParallel needs an mpcomm.Communicator, got {type(comm).__name__}")
        try:
            self.strategy = ShardingStrategy(sharding_strategy)
        except ValueError:
            raise ValueError(f"unknown sharding_strategy {sharding_strategy!r}; choose one of "
                             f"{[s.value for s in ShardingStrategy]}") from None
        if spec is not None:
            check_compression(spec, self.strategy.value)
        if backward_prefetch is not None:
            try:
                backward_prefetch = BackwardPrefetch(backward_prefetch).value
            except ValueError:
                raise ValueError(f"backward_prefetch must be 'pre', 'post' or None, got {backward_prefetch!r}") from None
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
            raise TypeError("mixed_precision must be a MixedPrecision or None")
        named = module.named_parameters()
        if not named:
            raise ValueError("FullyShardedDataParallel: the module has no parameters")
        self.module, self.comm = module, comm
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.xp = array_module(*[p.data for _, p in named])
        self.cpu_offload_active = bool(cpu_offload) and self.xp is not np
        plans = plan_units(module, as_policy(auto_wrap_policy))
        check_same_model(comm, "FullyShardedDataParallel", _describe(plans, self.strategy.value), _differences)
        self.groups = _make_groups(comm, self.strategy)
        self.tracker = MemoryTracker()
        self.units = [self._build_unit(plan, sync_module_states) for plan in plans]
        self.compressor = None if spec is None else ShardedCompressor(
            spec, comm, self.units, {n: i for i, (n, _) in enumerate(named)})
        for u in self.units:
            u.compressor = self.compressor
        reshard = self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        self.schedule = Schedule(self.units, reshard, backward_prefetch, bool(forward_prefetch),
                                 bool(limit_all_gathers))
        self._hooks = []
        for u in self.units:
            m, s = u.module, self.schedule
            self._hooks += [m.register_forward_pre_hook(lambda _m, u=u: s.pre_forward(u)),
                            m.register_forward_post_hook(lambda _m, u=u: s.post_forward(u)),
                            m.register_backward_pre_hook(lambda _m, u=u: s.pre_backward(u)),
                            m.register_backward_post_hook(lambda _m, u=u: s.post_backward(u))]
        self._in_step = False
        self._input_dtype = None

    # ---- construction ------------------------------------------------------------------------
    def _build_unit(self, plan: UnitPlan, sync: bool) -> FlatUnit:
        dtypes = {np.dtype(p.data.dtype) for _, p in plan.params}
        if len(dtypes) != 1:
            raise ValueError(f"FSDP unit {plan.name or '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}")
        master = dtypes.pop()
        if master not in _FLOAT_DTYPES:
            raise TypeError(f"FSDP unit {plan.name or '<root>'!r}: parameters must be floating point, got {master}")
        layout = FlatLayout.build([(n, p.shape) for n, p in plan.params], self.groups.shard_count)
        flat = layout.flatten([p.data for _, p in plan.params], self.xp, master)
        if sync and self.comm.size > 1:
            self.comm.broadcast(flat, root=0)
        lo, hi = layout.shard_range(self.groups.shard_index)
        data = to_numpy(flat[lo:hi]) if self.cpu_offload_active else flat[lo:hi].copy()
        del flat
        shard = Parameter(data, name=f"{plan.name}._flat_param" if plan.name else "_flat_param")
        param_dtype = self.mixed_precision.param_dtype or master
        unit = FlatUnit(plan.name, plan.module, layout, [p for _, p in plan.params], shard, self.groups, self.xp,
                        param_dtype, self.mixed_precision.reduce_dtype or param_dtype, self.cpu_offload_active,
                        self.tracker)
        if unit.aliases_shard:  # no_shard in the model's dtype: the originals simply view the shard, always
            unit.full, unit.state = shard.data, "gathered"
            for p, view in zip(unit.originals, layout.views(shard.data)):
                p.data = view
        else:
            for p, info in zip(unit.originals, layout.params):
                p.data = placeholder(info.shape, param_dtype, self.xp)
        return unit

    # ---- engine protocol ---------------------------------------------------------------------
    def forward(self, x: Any) -> tuple[Any, Any]:
        if not self._in_step:
            self.tracker.reset_peaks()
        self._in_step = self.module.training
        self.schedule.begin_forward()
        mp = self.mixed_precision.param_dtype
        self._input_dtype = x.dtype if _is_float(x) else None
        if mp is not None and self._input_dtype is not None:
            x = x.astype(mp, copy=False)
        try:
            out = self.module.forward(x)
        except BaseException:
            self.schedule.release_all()
            raise
        self.schedule.end_forward(self.module.training)
        return out

    def backward(self, grad_y: Any, ctx: Any) -> Any:
        """Backward through the model; on return every unit's shard ``.grad`` holds the averaged gradient."""
        mp = self.mixed_precision.param_dtype
        if mp is not None and _is_float(grad_y):
            grad_y = grad_y.astype(mp, copy=False)
        gx = self.module.backward(grad_y, ctx)
        self.schedule.end_backward()
        if self.compressor is not None:
            self.compressor.finish_step()
        self._in_step = False
        if gx is not None and self._input_dtype is not None and _is_float(gx) and gx.dtype != self._input_dtype:
            gx = gx.astype(self._input_dtype)
        return gx

    def parameters(self) -> list[Parameter]:
        """The flat shards (one per unit), in unit order: give these to the optimizer."""
        return [u.shard for u in self.units]

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        return [(u.shard.name, u.shard) for u in self.units]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for u in self.units:
            u.shard.zero_grad(set_to_none)

    def __call__(self, x: Any) -> Any:
        return self.forward(x)[0]

    def __repr__(self) -> str:
        return (f"FullyShardedDataParallel(strategy={self.strategy.value}, units={len(self.units)}, "
                f"shards={self.groups.shard_count}, world={self.comm.size})")

    # ---- full (unsharded) views, collective over the engine's ranks ---------------------------
    def _gather_flat(self, u: FlatUnit, shard_array: Any) -> np.ndarray:
        """Host numpy copy of a unit-flat array sharded like ``u`` (params or optimizer state)."""
        if self.groups.shard_count == 1:
            return to_numpy(shard_array)
        xp = array_module(shard_array)
        recv = xp.empty(u.layout.padded_numel, dtype=shard_array.dtype)
        assert self.groups.shard is not None  # more than one shard
        self.groups.shard.all_gather(shard_array, recv)
        return to_numpy(recv)

    def full_state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Name -> full parameter (host numpy, master dtype), identical on every rank. Collective."""
        arrays = {}
        for u in self.units:
            full = self._gather_flat(u, u.shard.data)
            for info, view in zip(u.layout.params, u.layout.views(full)):
                arrays[info.name] = view.copy()
        return OrderedDict((n, arrays[n]) for n, _ in self.module.named_parameters())

    def load_full_state_dict(self, state: dict) -> None:
        """Take this rank's shard of every parameter from a full state dict (names and shapes must match)."""
        expected = [info.name for u in self.units for info in u.layout.params]
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise KeyError(f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for u in self.units:
            flat = u.layout.flatten([np.asarray(to_numpy(state[i.name])) for i in u.layout.params], np,
                                    u.master_dtype)
            lo, hi = u.layout.shard_range(self.groups.shard_index)
            u.shard.data[...] = flat[lo:hi] if array_module(u.shard.data) is np else self.xp.asarray(flat[lo:hi])

    def full_optim_state_dict(self, optimizer: Optimizer) -> dict:
        """``{param name: {key: full array or scalar}}`` from an optimizer over ``self.parameters()``. Collective."""
        check_optimizer(self, optimizer)
        out: dict = {}
        for i, u in enumerate(self.units):
            state = optimizer.state.get(i, {})
            per_param: dict[str, dict] = {info.name: {} for info in u.layout.params}
            for key in sorted(state):
                value = state[key]
                if hasattr(value, "shape") and tuple(value.shape) == u.shard.shape:
                    full = self._gather_flat(u, value)
                    for info, view in zip(u.layout.params, u.layout.views(full)):
                        per_param[info.name][key] = view.copy()
                else:
                    for d in per_param.values():
                        d[key] = value
            out.update(per_param)
        return out

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_sharded(self, path: str, optimizer: Optimizer | None = None) -> None:
        """Each rank writes its shards (and optimizer moments) atomically; see ``fsdp_checkpoint``. Collective."""
        fsdp_checkpoint.save_sharded(self, path, optimizer)

    def load_sharded(self, path: str, optimizer: Optimizer | None = None) -> None:
        """Load a sharded checkpoint written at any world size. Collective."""
        fsdp_checkpoint.load_sharded(self, path, optimizer)

    def save_full(self, path: str) -> None:
        """Gather the full state dict (collective) and write it on rank 0 as one ``.npz`` (atomic)."""
        fsdp_checkpoint.save_full(self, path)

    # ---- gradient compression ------------------------------------------------------------------
    def compression_state_dict(self) -> dict | None:
        """This rank's compression state (steps, its error per unit), or None without compression. ``save_sharded``
        stores it with the checkpoint; see :mod:`mpcomm.parallel.fsdp_compression`."""
        return None if self.compressor is None else self.compressor.state_dict(self.units)

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore :meth:`compression_state_dict` (this rank's)."""
        if self.compressor is None:
            raise ConfigError("load_compression_state_dict: this FullyShardedDataParallel has no compression")
        self.compressor.load_state_dict(state, self.units)

    def compression_choices(self) -> list[str]:
        """What each unit's last gradient reduction did ("exact" or the wire), in unit order (units not reduced
        by a reduce-scatter yet are left out); empty without compression."""
        if self.compressor is None:
            return []
        return [self.compressor.last_choice[u.name] for u in self.units if u.name in self.compressor.last_choice]

    # ---- measurements --------------------------------------------------------------------------
    def memory_stats(self, optimizer: Optimizer | None = None) -> dict[str, int]:
        """Bytes measured from the arrays alive now, plus the peaks of transient buffers in the last step.

        ``peak_param_bytes`` = sharded params + peak of gathered param buffers alive at once.
        ``peak_total_bytes`` = sharded params + sharded grads + optimizer state (as they are now)
        + the peak of gathered params and unsharded gradients alive at once during the last step.
        ``compression_error_bytes``: the error feedback buffers kept between steps (compression), in neither;
        ``compression_q_bytes``: PowerSGD's Q matrices kept between steps (the P and Q sent are transient).
        """
        sharded = sum(int(u.shard.data.nbytes) for u in self.units)
        grads = sum(int(u.shard.grad.nbytes) for u in self.units if u.shard.grad is not None)
        optim = 0
        if optimizer is not None:
            check_optimizer(self, optimizer)
            optim = sum(int(v.nbytes) for s in optimizer.state.values() for v in s.values() if hasattr(v, "nbytes"))
        t = self.tracker
        return {
            "sharded_param_bytes": sharded,
            "sharded_grad_bytes": grads,
            "optimizer_state_bytes": optim,
            "gathered_param_bytes": t.current["gathered"],
            "unsharded_grad_bytes": t.current["grad"],
            "peak_gathered_param_bytes": t.peak["gathered"],
            "peak_unsharded_grad_bytes": t.peak["grad"],
            "peak_transient_bytes": t.peak_total,
            "peak_param_bytes": sharded + t.peak["gathered"],
            "peak_total_bytes": sharded + grads + optim + t.peak_total,
            "full_model_bytes": sum(u.layout.numel * u.master_dtype.itemsize for u in self.units),
            "largest_unit_bytes": max(u.layout.padded_numel * np.dtype(u.param_dtype).itemsize for u in self.units),
            "padding_elements": sum(u.layout.padding for u in self.units),
            "compression_error_bytes": 0 if self.compressor is None else self.compressor.error_bytes(),
            "compression_q_bytes": 0 if self.compressor is None else self.compressor.q_bytes(),
        }

    def schedule_stats(self) -> dict[str, int]:
        """Counters since construction: all_gathers, prefetched, prefetch_hits, max_inflight_all_gathers, reduces."""
        return dict(self.schedule.counters)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


# ---- construction helpers (collective) ------------------------------------------------------------
def _describe(plans: list[UnitPlan], strategy: str) -> list:
    return [strategy] + [[plan.name, [[n, list(p.shape), str(p.data.dtype)] for n, p in plan.params]]
                         for plan in plans]


def _differences(descriptions: list[list]) -> str:
    first = descriptions[0]
    return "; ".join(f"rank {r}: {_first_difference(first, d)}" for r, d in enumerate(descriptions) if d != first)


def _first_difference(a: list, b: list) -> str:
    if a[0] != b[0]:
        return f"sharding_strategy {b[0]!r} vs {a[0]!r}"
    pa = {n: (s, d) for unit in a[1:] for n, s, d in unit[1]}
    pb = {n: (s, d) for unit in b[1:] for n, s, d in unit[1]}
    for n in pa:
        if n not in pb:
            return f"parameter {n!r} missing"
        if pa[n] != pb[n]:
            return f"parameter {n!r} has shape {tuple(pb[n][0])} {pb[n][1]} here but {tuple(pa[n][0])} {pa[n][1]} on rank 0"
    extra = sorted(set(pb) - set(pa))
    if extra:
        return f"extra parameters {extra}"
    return f"different wrapping into units: {[u[0] for u in b[1:]]} vs {[u[0] for u in a[1:]]} on rank 0"


def _node_key(comm: Communicator) -> int:
    if comm.ranks_per_node:
        return comm.rank // comm.ranks_per_node
    digest = hashlib.sha256(MPI.Get_processor_name().encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _make_groups(comm: Communicator, strategy: ShardingStrategy) -> Groups:
    if strategy == ShardingStrategy.NO_SHARD:
        return Groups(shard=None, replicate=comm)
    if strategy != ShardingStrategy.HYBRID_SHARD:
        return Groups(shard=comm, replicate=None)
    keys = np.empty(comm.size, dtype=np.int64)
    comm.all_gather(np.array([_node_key(comm)], dtype=np.int64), keys)
    node = int(np.flatnonzero(keys == keys[comm.rank])[0])  # lowest world rank on my node names the node
    shard = comm.split(node)
    assert shard is not None  # a color on every rank
    sizes = np.empty(comm.size, dtype=np.int64)
    comm.all_gather(np.array([shard.size], dtype=np.int64), sizes)
    if len(set(sizes.tolist())) != 1:
        shard.free()
        raise ConfigError(f"hybrid_shard needs the same number of ranks on every node; node sizes per rank: "
                          f"{sizes.tolist()} (set ranks_per_node to a divisor of the world size {comm.size})")
    replicate = comm.split(shard.rank)
    return Groups(shard=shard, replicate=replicate)
