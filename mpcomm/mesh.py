"""Parallel mesh: rank layout as a pure function, a validated configuration, and the communicators.

Layout (Megatron-LM ``RankGenerator`` style)
--------------------------------------------
``order`` names the dimensions, leftmost varying fastest.  With ``order="tp-dp-pp"`` (the default, tensor-parallel
peers adjacent so they share a node)::

    global = tp + dp * TP + pp * (TP * DP)

and with ``order="pp-tp-dp"`` the reference layout ``global = dp * (TP * PP) + tp * PP + pp``.  :func:`rank_groups`,
:func:`coords_of` and :func:`rank_of` compute everything from the sizes and the order without MPI;
:class:`ParallelMesh` only calls ``Comm.Split`` with the colours they give.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence, Union, cast

from mpcomm.errors import ConfigError

if TYPE_CHECKING:
    from mpi4py import MPI

    from mpcomm.comm import Communicator
    from mpcomm.schedules import Action

__all__ = [
    "DIMS", "DEFAULT_ORDER", "parse_order", "rank_groups", "coords_of", "rank_of", "format_groups",
    "ParallelConfig", "ParallelMesh", "MEMORY_STRATEGIES", "MIXED_PRECISIONS",
]

DIMS = ("dp", "tp", "pp")
DEFAULT_ORDER = "tp-dp-pp"
Order = Union[str, Sequence[str]]


# ------------------------------------------------------------------------------------------------ pure layout

def parse_order(order: Order, sizes: Mapping[str, int] | None = None) -> tuple[str, ...]:
    """``"tp-dp-pp"`` -> ``("tp", "dp", "pp")``; checks it is a permutation of the dimensions."""
    dims = tuple(order.split("-")) if isinstance(order, str) else tuple(order)
    want = tuple(sizes) if sizes is not None else DIMS
    if len(set(dims)) != len(dims) or set(dims) != set(want):
        raise ConfigError(f"order {order!r} must be a permutation of the dimensions {', '.join(want)} "
                          f"(joined by '-', leftmost varies fastest, e.g. {'-'.join(want)!r})")
    return dims


def _check(world_size: int | None, sizes: Mapping[str, int], order: Order) -> tuple[str, ...]:
    dims = parse_order(order, sizes)
    for d in dims:
        s = sizes[d]
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ConfigError(f"parallel size {d}={s!r} must be a positive integer")
    if world_size is not None:
        prod = math.prod(sizes[d] for d in dims)
        if prod != world_size:
            expr = "*".join(f"{d}" for d in dims)
            vals = "*".join(str(sizes[d]) for d in dims)
            raise ConfigError(f"{expr} == world_size is required, but {vals} = {prod} != {world_size}")
    return dims


def _strides(dims: Sequence[str], sizes: Mapping[str, int]) -> dict[str, int]:
    strides, acc = {}, 1
    for d in dims:
        strides[d] = acc
        acc *= sizes[d]
    return strides


def rank_of(coords: Mapping[str, int], sizes: Mapping[str, int], order: Order = DEFAULT_ORDER) -> int:
    """Global rank of the coordinates (leftmost dimension of ``order`` varies fastest)."""
    dims = _check(None, sizes, order)
    st = _strides(dims, sizes)
    rank = 0
    for d in dims:
        c = coords[d]
        if not 0 <= c < sizes[d]:
            raise ConfigError(f"coordinate {d}={c} out of range [0, {sizes[d]})")
        rank += c * st[d]
    return rank


def coords_of(rank: int, sizes: Mapping[str, int], order: Order = DEFAULT_ORDER) -> dict[str, int]:
    """Coordinates ``{dim: index}`` of a global rank; inverse of :func:`rank_of`."""
    dims = _check(None, sizes, order)
    world = math.prod(sizes[d] for d in dims)
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} out of range [0, {world})")
    out = {}
    for d in dims:
        out[d] = rank % sizes[d]
        rank //= sizes[d]
    return {d: out[d] for d in sizes}


def rank_groups(world_size: int, sizes: Mapping[str, int], order: Order = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """For each dimension, the list of its rank groups (pure; no MPI).

    A group of dimension ``d`` holds the ranks that share every other coordinate, sorted by their ``d``
    coordinate.  Groups are numbered like Megatron's ``generate_masked_orthogonal_rank_groups``: by the other
    coordinates, enumerated with the leftmost dimension of ``order`` varying fastest.  The index of the group that
    holds a rank is the colour :class:`ParallelMesh` gives ``Comm.Split``; the position inside it is the key.
    """
    dims = _check(world_size, sizes, order)
    st = _strides(dims, sizes)
    out: dict[str, list[list[int]]] = {}
    for d in dims:
        others = [o for o in dims if o != d]
        ngroups = math.prod(sizes[o] for o in others)
        groups = []
        for g in range(ngroups):
            base, rest = 0, g
            for o in others:
                base += (rest % sizes[o]) * st[o]
                rest //= sizes[o]
            groups.append([base + i * st[d] for i in range(sizes[d])])
        out[d] = groups
    return {d: out[d] for d in sizes}


def _locate(groups: list[list[int]], rank: int) -> tuple[int, int]:
    for gi, g in enumerate(groups):
        if rank in g:
            return gi, g.index(rank)
    raise ConfigError(f"rank {rank} is in no group")  # cannot happen for a validated layout


def format_groups(world_size: int, sizes: Mapping[str, int], order: Order = DEFAULT_ORDER) -> str:
    """Megatron-style printout of every group and of each rank's coordinates."""
    dims = _check(world_size, sizes, order)
    groups = rank_groups(world_size, sizes, order)
    lines = [f"world {world_size}, order {'-'.join(dims)} (leftmost varies fastest): "
             + " ".join(f"{d}={sizes[d]}" for d in sizes)]
    for d in dims:
        lines.append(f"  {d} groups ({len(groups[d])}): " + " ".join(str(g) for g in groups[d]))
    lines.append("  rank: " + " ".join(f"{d:>3}" for d in sizes))
    for r in range(world_size):
        c = coords_of(r, sizes, order)
        lines.append(f"  {r:>4}: " + " ".join(f"{c[d]:>3}" for d in sizes))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- configuration

MEMORY_STRATEGIES = ("none", "activation_checkpointing", "zero1", "zero2", "zero3", "fsdp")
MIXED_PRECISIONS = (None, "fp16", "bf16")
_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass
class ParallelConfig:
    """A 3-D (data x tensor x pipeline) parallel training configuration.

    ``memory_strategy``: ``"none"``; ``"activation_checkpointing"`` (same as ``gradient_checkpointing=True``);
    ``"zero1"`` (optimizer state sharded over dp), ``"zero2"`` (+ gradients), ``"zero3"`` / ``"fsdp"`` (+ params).
    ``max_memory_per_device`` is in bytes (``None``: no limit); ``comm_timeout`` in seconds.
    ``hidden_size`` etc. are optional model dimensions used by :meth:`validate` for the memory check.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    num_layers: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    memory_strategy: str = "none"
    mixed_precision: str | None = None
    gradient_checkpointing: bool = False
    max_memory_per_device: int | None = None
    comm_timeout: float = 30.0
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    vocab_size: int = 0
    seq_len: int = 1
    num_heads: int | None = None

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.num_micro_batches

    @property
    def num_stages(self) -> int:
        """Pipeline stages including virtual ones: ``pp * virtual_stages``."""
        return self.pp * self.virtual_stages

    def layers_per_stage(self) -> int:
        """Layers on each pipeline rank (``num_layers // pp``; with interleaving spread over its v chunks)."""
        return self.num_layers // self.pp

    def layers_per_chunk(self) -> int:
        """Layers per virtual stage: ``num_layers // (pp * virtual_stages)``."""
        return self.num_layers // self.num_stages

    @property
    def checkpointing(self) -> bool:
        return self.gradient_checkpointing or self.memory_strategy == "activation_checkpointing"

    @property
    def zero_stage(self) -> int:
        return {"zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}.get(self.memory_strategy, 0)

    def pipeline_schedule(self) -> list[list[Action]]:
        """Per-rank compute action lists of :attr:`schedule` (see :mod:`mpcomm.schedules`)."""
        from mpcomm.schedules import schedule
        return schedule(self.schedule, self.pp, self.num_micro_batches, self.virtual_stages)

    # ---------------------------------------------------------------- validate
    def validate(self, world_size: int | None = None, **estimate_kwargs: Any) -> "ParallelConfig":
        """Raise :class:`ConfigError` (a ``ValueError``) naming the first failed constraint; return ``self``.

        Checked: positive integer sizes; ``dp*tp*pp == world_size`` (when given); known schedule, memory strategy
        and precision; ``num_layers % pp == 0``; ``virtual_stages > 1`` only with ``interleaved-1f1b``; for
        interleaved ``num_layers % (pp*v) == 0``, ``num_micro_batches >= pp`` and ``num_micro_batches % pp == 0``
        (Megatron's requirement); ``comm_timeout > 0``; and, when ``max_memory_per_device`` is set and a model
        size is known (``hidden_size`` here or ``hidden=`` in ``estimate_kwargs``), ``memory_estimate()['total']
        <= max_memory_per_device``.  Without a model size the memory check is skipped (nothing to estimate).
        """
        for name in ("dp", "tp", "pp", "num_layers", "micro_batch_size", "num_micro_batches", "virtual_stages"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ConfigError(f"{name} must be a positive integer (> 0), got {val!r}")
        if world_size is not None and self.world_size != world_size:
            raise ConfigError(f"dp*tp*pp == world_size is required, but {self.dp}*{self.tp}*{self.pp} = "
                              f"{self.world_size} != {world_size}")
        if self.schedule not in _SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; expected one of {', '.join(_SCHEDULES)}")
        if self.memory_strategy not in MEMORY_STRATEGIES:
            raise ConfigError(f"unknown memory_strategy {self.memory_strategy!r}; expected one of "
                              f"{', '.join(MEMORY_STRATEGIES)}")
        if self.mixed_precision not in MIXED_PRECISIONS:
            raise ConfigError(f"mixed_precision must be None, 'fp16' or 'bf16', got {self.mixed_precision!r}")
        if self.num_layers % self.pp:
            raise ConfigError(f"num_layers % pp == 0 is required, but {self.num_layers} % {self.pp} = "
                              f"{self.num_layers % self.pp}")
        v = self.virtual_stages
        if self.schedule == "interleaved-1f1b":
            if self.num_layers % (self.pp * v):
                raise ConfigError(f"num_layers % (pp*virtual_stages) == 0 is required for interleaved-1f1b, but "
                                  f"{self.num_layers} % ({self.pp}*{v}) = {self.num_layers % (self.pp * v)}")
            if self.num_micro_batches < self.pp or self.num_micro_batches % self.pp:
                raise ConfigError(f"interleaved-1f1b requires num_micro_batches >= pp and num_micro_batches % pp "
                                  f"== 0, got num_micro_batches={self.num_micro_batches}, pp={self.pp}")
        elif v != 1:
            raise ConfigError(f"virtual_stages={v} > 1 requires schedule 'interleaved-1f1b', "
                              f"not {self.schedule!r}")
        if not (isinstance(self.comm_timeout, (int, float)) and self.comm_timeout > 0):
            raise ConfigError(f"comm_timeout must be > 0 seconds, got {self.comm_timeout!r}")
        limit = self.max_memory_per_device
        if limit is not None:
            if not (isinstance(limit, (int, float)) and limit > 0):
                raise ConfigError(f"max_memory_per_device must be a positive number of bytes, got {limit!r}")
            if estimate_kwargs.get("hidden", self.hidden_size) is not None:
                est = self.memory_estimate(**estimate_kwargs)
                if est["total"] > limit:
                    parts = ", ".join(f"{k} {n / 2**30:.2f} GiB" for k, n in est.items() if k != "total")
                    raise ConfigError(f"memory_estimate total {est['total'] / 2**30:.2f} GiB exceeds "
                                      f"max_memory_per_device {limit / 2**30:.2f} GiB ({parts})")
        return self

    # ---------------------------------------------------------- memory estimate
    def memory_estimate(self, hidden: int | None = None, ffn_hidden: int | None = None, vocab: int | None = None,
                        seq_len: int | None = None, dtype_bytes: int = 4, num_heads: int | None = None,
                        bucket_bytes: int = 25 * 2**20) -> dict[str, int]:
        """An *estimate* of the peak bytes per rank for a GPT-style transformer; parts and their formulas.

        Symbols: ``h`` hidden, ``f`` ffn hidden (default ``4h``), ``V`` vocab, ``s`` sequence length, ``b``
        micro-batch size, ``a`` heads (default ``max(1, h // 64)``), ``L`` layers per pipeline rank
        (``num_layers / pp``), ``t, d, p`` = tp, dp, pp sizes.  ``w`` = bytes of a parameter / activation element:
        2 with mixed precision, else ``dtype_bytes``.  The rank counted is the most loaded one (a first/last
        stage, which also holds the embedding or the tied output layer).

        * parameters ``Ψ = L * ((4h² + 2hf + 3h + f) / t + 6h) + V*h / t``: attention QKV+output and MLP
          matrices with their column-parallel biases are split over tp; row-parallel biases and the two
          LayerNorms (``6h``) are replicated; the embedding is vocab-parallel.
        * ``params = w Ψ``, ``grads = w Ψ``; ``optimizer_state = 8 Ψ`` (Adam m and v in fp32) ``+ 4 Ψ`` fp32
          master weights with mixed precision (the ZeRO paper's K = 12).
        * ZeRO: ``zero1`` divides optimizer_state by ``d``; ``zero2`` also grads; ``zero3``/``fsdp`` also params.
        * activations per layer and micro-batch (Korthikanti et al. 2022, no sequence parallelism):
          ``s b h (10 + 24/t + 5 a s / (h t)) * w / 2`` bytes; times the layers per chunk and the peak number of
          micro-batch chunks alive on a rank, taken from the schedule itself (``m`` for GPipe, ``min(p, m)`` on
          rank 0 for 1F1B, Megatron's warm-up + 1 for interleaved).  With checkpointing only each layer's input is
          kept (``s b h w`` per layer and alive chunk) plus one layer's full activations for the recomputation.
        * communication_buffers: pipeline send/recv buffers ``4 s b h w`` (p > 1); tensor-parallel all-reduce
          buffer ``s b h w`` (t > 1); data-parallel gradient bucket ``min(bucket_bytes, grads)`` (d > 1, not
          zero3); zero3 all-gather of one layer's full (tp-local) parameters.
        * ``total`` = sum of the above.

        Not counted: logits / loss buffers, framework workspaces, fragmentation; treat the result as a lower bound.
        """
        from mpcomm.schedules import peak_in_flight, schedule

        h = self.hidden_size if hidden is None else hidden
        if h is None or h < 1:
            raise ConfigError("memory_estimate needs hidden (> 0) or ParallelConfig.hidden_size")
        f = ffn_hidden if ffn_hidden is not None else (self.ffn_hidden_size or 4 * h)
        V = self.vocab_size if vocab is None else vocab
        s = self.seq_len if seq_len is None else seq_len
        a = num_heads if num_heads is not None else (self.num_heads or max(1, h // 64))
        b, t, d, p = self.micro_batch_size, self.tp, self.dp, self.pp
        w = 2 if self.mixed_precision else dtype_bytes
        L = self.num_layers / p

        layer_params = (4 * h * h + 2 * h * f + 3 * h + f) / t + 6 * h
        psi = L * layer_params + V * h / t
        params, grads = w * psi, w * psi
        optimizer = 8 * psi + (4 * psi if self.mixed_precision else 0)
        z = self.zero_stage
        if z >= 1:
            optimizer /= d
        if z >= 2:
            grads /= d
        if z >= 3:
            params /= d

        try:
            sched = schedule(self.schedule, p, self.num_micro_batches, self.virtual_stages)
            chunks_alive = max(peak_in_flight(sched))
        except Exception:  # invalid schedule parameters: fall back to the GPipe worst case
            chunks_alive = self.num_micro_batches * self.virtual_stages
        layers_per_chunk = L / self.virtual_stages
        full_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * w / 2
        if self.checkpointing:
            activations = chunks_alive * layers_per_chunk * s * b * h * w + full_layer
        else:
            activations = chunks_alive * layers_per_chunk * full_layer

        comm = 0.0
        if p > 1:
            comm += 4 * s * b * h * w
        if t > 1:
            comm += s * b * h * w
        if d > 1 and z < 3:
            comm += min(bucket_bytes, grads)
        if z >= 3 and d > 1:
            comm += layer_params * w
        parts = {"params": params, "grads": grads, "optimizer_state": optimizer,
                 "activations": activations, "communication_buffers": comm}
        out = {k: int(math.ceil(v)) for k, v in parts.items()}
        out["total"] = sum(out.values())
        return out


# ------------------------------------------------------------------------------------------------------ mesh

class ParallelMesh:
    """The dp, tp and pp sub-communicators of one rank, built with ``Comm.Split`` from :func:`rank_groups`.

    An ordinary object: several meshes (different sizes or orders) can coexist over the same communicator.
    ``comm`` is an :class:`mpcomm.Communicator` (or a raw mpi4py communicator, which is wrapped).  All ranks of
    ``comm`` must construct the mesh together: every rank calls ``split`` three times, for dp, tp, pp in that order,
    with colour = index of its group and key = its position in the group, so the rank of this process inside
    ``mesh.pp`` is its pp coordinate (likewise dp, tp).
    """

    def __init__(self, comm: Communicator | MPI.Comm, dp: int = 1, tp: int = 1, pp: int = 1,
                 order: Order = DEFAULT_ORDER):
        if not hasattr(comm, "split") and hasattr(comm, "Split"):  # raw mpi4py communicator
            from mpcomm.comm import Communicator
            comm = Communicator(comm)
        comm = cast("Communicator", comm)  # (wrapped above if it was a raw mpi4py communicator)
        self.world = comm
        self.sizes = {"dp": dp, "tp": tp, "pp": pp}
        self.order = "-".join(_check(None, self.sizes, order))
        size, rank = comm.size, comm.rank
        if dp * tp * pp != size:
            raise ConfigError(f"dp*tp*pp == world size is required, but {dp}*{tp}*{pp} = {dp * tp * pp} != "
                              f"communicator size {size}")
        self.groups = rank_groups(size, self.sizes, self.order)
        self.rank = rank
        self.coords = coords_of(rank, self.sizes, self.order)
        subs = {}
        for d in DIMS:  # identical sequence of collective splits on every rank
            color, key = _locate(self.groups[d], rank)
            sub = comm.split(color, key=key)
            assert sub is not None  # a colour on every rank
            subs[d] = sub
        self.dp, self.tp, self.pp = subs["dp"], subs["tp"], subs["pp"]

    # ------------------------------------------------------------------ layout
    @property
    def world_size(self) -> int:
        return self.world.size

    def rank_of(self, dp: int | None = None, tp: int | None = None, pp: int | None = None) -> int:
        """Global rank of the given coordinates; omitted ones default to this rank's."""
        c = dict(self.coords)
        for k, val in (("dp", dp), ("tp", tp), ("pp", pp)):
            if val is not None:
                c[k] = val
        return rank_of(c, self.sizes, self.order)

    def coords_of(self, rank: int) -> dict[str, int]:
        return coords_of(rank, self.sizes, self.order)

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's group along ``dim`` (ordered as the sub-communicator's ranks)."""
        return self.groups[dim][_locate(self.groups[dim], self.rank)[0]]

    @property
    def next_pp_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last)."""
        k = self.coords["pp"]
        return None if k == self.sizes["pp"] - 1 else self.rank_of(pp=k + 1)

    @property
    def prev_pp_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first)."""
        k = self.coords["pp"]
        return None if k == 0 else self.rank_of(pp=k - 1)

    @property
    def next_pp_group_rank(self) -> int | None:
        """Rank of the next stage inside ``mesh.pp`` (None on the last)."""
        k = self.coords["pp"]
        return None if k == self.sizes["pp"] - 1 else k + 1

    @property
    def prev_pp_group_rank(self) -> int | None:
        """Rank of the previous stage inside ``mesh.pp`` (None on the first)."""
        k = self.coords["pp"]
        return None if k == 0 else k - 1

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.sizes["pp"] - 1

    @property
    def is_dp_head(self) -> bool:
        return self.coords["dp"] == 0

    @property
    def is_tp_head(self) -> bool:
        return self.coords["tp"] == 0

    def format_groups(self) -> str:
        return format_groups(self.world.size, self.sizes, self.order)

    def free(self) -> None:
        """Release the three sub-communicators (optional; MPI finalisation releases them too)."""
        for sub in (self.dp, self.tp, self.pp):
            fn = getattr(sub, "free", None)
            if fn is not None:
                fn()
            elif getattr(sub, "mpi", None) is not None:
                sub.mpi.Free()

    def __repr__(self) -> str:
        s = self.sizes
        return (f"ParallelMesh(rank={self.rank}/{self.world.size}, order={self.order!r}, dp={s['dp']}, "
                f"tp={s['tp']}, pp={s['pp']}, coords=(dp={self.coords['dp']}, tp={self.coords['tp']}, "
                f"pp={self.coords['pp']}))")
