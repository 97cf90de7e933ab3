"""Pipeline parallelism: :class:`PipelineParallel` runs the action lists of :mod:`mpcomm.parallel.schedules`.

The model is split into ``pp * v`` contiguous stages (:func:`partition_layers`); each step runs this rank's list
through :class:`~mpcomm.parallel.pipeline_executor.StepExecutor`. How hand-offs travel (MPI or the node's shared
memory), what is timed and traced, and why: docs/pipeline.md.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from mpcomm.errors import ConfigError
from mpcomm.nn import Sequential, mse_loss
from mpcomm.nn.backend import array_module

from mpcomm.transport import Transport

if TYPE_CHECKING:
    from mpcomm.comm import Communicator
    from mpcomm.mesh import ParallelMesh

from .pipeline_executor import Receive, StepExecutor, StepState, instruction
from .pipeline_shapes import StageShapes, chunk_array_module, infer_shapes
from .schedules import B, F, RECV_F, SCHEDULES, SEND_B, message_tag, schedule as make_schedule, with_communication
from .send_progress import measure_spin_after_send
from .shared_handoff import SharedHandoffs
from .tensor import gather_full_state

__all__ = ["PipelineParallel", "partition_layers"]


# ------------------------------------------------------------------------------------------ partitioning

def partition_layers(module: Sequential, num_stages: int, balance: Any = "layers") -> list[tuple[int, int]]:
    """``[(start, end), ...]`` layer ranges of the ``num_stages`` contiguous stages (pure; same on every rank).

    ``balance``: ``"layers"`` — equal layer counts, requires ``num_layers % num_stages == 0``; ``"params"`` —
    contiguous split minimising the largest per-stage parameter count (every stage >= 1 layer); or an explicit
    list of ``num_stages`` positive layer counts summing to ``num_layers``.
    """
    n = len(module)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"number of stages (pp*virtual_stages) must be a positive integer, got {num_stages!r}")
    if isinstance(balance, str):
        if balance == "layers":
            if n % num_stages:
                raise ConfigError(f"num_layers % (pp*virtual_stages) == 0 is required for balance='layers', but "
                                  f"{n} % {num_stages} = {n % num_stages}")
            k = n // num_stages
            return [(i * k, (i + 1) * k) for i in range(num_stages)]
        if balance == "params":
            if n < num_stages:
                raise ConfigError(f"num_layers >= pp*virtual_stages is required (every stage needs a layer), got "
                                  f"{n} layers for {num_stages} stages")
            return _balanced_by_weight([m.num_parameters() for m in module], num_stages)
        raise ConfigError(f"balance must be 'layers', 'params' or a list of layer counts, got {balance!r}")
    sizes = list(balance)
    if len(sizes) != num_stages or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes) \
            or sum(sizes) != n:
        raise ConfigError(f"an explicit balance needs pp*virtual_stages = {num_stages} positive layer counts summing "
                          f"to num_layers = {n}, got {sizes}")
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def _balanced_by_weight(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous split of ``weights`` into ``parts`` non-empty ranges minimising the maximum range sum (DP)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: minimal max-sum splitting the first i layers into k parts; cut[k][i]: where the last part starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:  # strict: earliest cut on ties, deterministic
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


# ------------------------------------------------------------------------------------------ the engine

def _pp_comm(mesh_or_comm):
    if hasattr(mesh_or_comm, "pp") and hasattr(mesh_or_comm, "coords"):
        return mesh_or_comm.pp
    if hasattr(mesh_or_comm, "isend") and hasattr(mesh_or_comm, "size"):
        return mesh_or_comm
    raise TypeError(f"PipelineParallel needs a ParallelMesh or a pipeline Communicator, got {type(mesh_or_comm)!r}")


class PipelineParallel:
    """Pipeline-parallel training of a :class:`~mpcomm.nn.Sequential` over the ``pp`` communicator.

    ``module`` is the whole model (identical structure on every rank; only this rank's chunks are run, so other
    chunks may stay unconverted).  ``balance``: see :func:`partition_layers`.  ``loss_fn(pred, target) ->
    (loss, grad)`` must average over the micro-batch (default :func:`~mpcomm.nn.mse_loss`).
    """

    def __init__(self, module: Sequential, mesh: ParallelMesh | Communicator, num_micro_batches: int,
                 schedule: str = "1f1b", virtual_stages: int = 1, balance: Any = "layers", recompute: bool = False,
                 loss_fn: Callable = mse_loss, max_posted_recvs: int | None = 4, tag_base: int = 0,
                 spin_after_send: float | str = "auto", shared_memory: bool = True):
        self.comm = _pp_comm(mesh)
        self.pp, self.rank = self.comm.size, self.comm.rank
        if schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
        for name, val in (("num_micro_batches", num_micro_batches), ("virtual_stages", virtual_stages)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ConfigError(f"{name} must be a positive integer, got {val!r}")
        if not isinstance(module, Sequential):
            raise TypeError(f"PipelineParallel splits an mpcomm.nn.Sequential, got {type(module).__name__}")
        self.module, self.num_micro_batches, self.schedule_name = module, num_micro_batches, schedule
        self.v = virtual_stages
        self.num_stages = self.pp * self.v
        # validates v vs schedule and, for interleaved, m >= pp and m % pp == 0 (ConfigError)
        compute = make_schedule(schedule, self.pp, num_micro_batches, self.v)
        self.bounds = partition_layers(module, self.num_stages, balance)
        self.chunks = [module[a:b] for a, b in self.bounds]  # slices share the modules and keep their names
        self.stages = [c * self.pp + self.rank for c in range(self.v)]  # stages held here
        self._all_actions = with_communication(compute, self.pp, self.v)
        self.actions = self._all_actions[self.rank]
        self._program = [instruction(a, num_micro_batches, tag_base) for a in self.actions]
        self.compute_actions = compute
        self.recompute, self.loss_fn = bool(recompute), loss_fn
        self.max_posted_recvs = max_posted_recvs
        self.tag_base = tag_base
        if spin_after_send != "auto" and (isinstance(spin_after_send, bool) or not isinstance(
                spin_after_send, (int, float)) or not 0 <= spin_after_send < float("inf")):
            raise ConfigError(f"spin_after_send must be 'auto' or a number of seconds >= 0, got {spin_after_send!r}")
        self._spin_setting = spin_after_send
        if not isinstance(shared_memory, bool):
            raise ConfigError(f"shared_memory must be True or False, got {shared_memory!r}")
        self.shared_memory = shared_memory
        # seconds each send is tested after it (see mpcomm.parallel.send_progress); "auto": measured at the first step
        self.spin_after_send: float | None = None if spin_after_send == "auto" else float(spin_after_send)
        ub = _tag_upper_bound(self.comm)
        top = tag_base + 2 * self.num_stages * num_micro_batches + 2 + self.num_stages  # data + shape tags
        if ub is not None and top > ub:
            raise ConfigError(f"pipeline message tags up to {top} exceed the MPI tag upper bound {ub}; use fewer "
                              f"stages or micro-batches")
        self._shapes: StageShapes | None = None
        self._in_key: tuple[tuple, str] | None = None  # the first stage's micro-batch (shape, dtype)
        self._recvs: list[Receive] | None = None  # see _receive_plan
        self._wire: Transport | None = None  # the hand-offs' own MPI channel, made at the first step if pp > 1
        self._shared: SharedHandoffs | None = None  # hand-offs within a node (made at the first step)
        self._stale_shared: SharedHandoffs | None = None  # the window of the shapes before reset_shapes()
        self._steps_called = 0  # train_step calls, failed ones included: names a step's flags in shared memory
        self.trace: list | None = None  # set to a list to record (label, t0, t1) per action (perf_counter)
        self.timing = {"compute": 0.0, "comm_wait": 0.0, "bubble": 0.0, "total": 0.0, "steps": 0}
        self.last_timing: dict[str, float] = {}

    # ---------------------------------------------------------------- parameters
    @property
    def is_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank == self.pp - 1

    def local_modules(self) -> list[Sequential]:
        return [self.chunks[s] for s in self.stages]

    def named_parameters(self) -> list[tuple[str, Any]]:
        """This rank's parameters with their full-model names (``"3.fc1.weight"``)."""
        out, seen = [], set()
        for chunk in self.local_modules():
            for n, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((n, p))
        return out

    def parameters(self) -> list:
        return [p for _, p in self.named_parameters()]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            p.zero_grad(set_to_none)

    def state_dict(self) -> "OrderedDict[str, Any]":
        """This rank's (possibly tensor-parallel-local) arrays by full-model name."""
        return OrderedDict((n, array_module(p.data).array(p.data, copy=True)) for n, p in self.named_parameters())

    def full_state_dict(self) -> "OrderedDict[str, Any]":
        """Every parameter of the whole model, full size, on every rank of the pipeline.

        Each stage's owner assembles its chunk (gathering tensor-parallel shards, see
        :func:`~mpcomm.parallel.tensor.gather_full_state`) and broadcasts it over the pp communicator; the other
        ranks take names and shapes from their (unconverted) copy of that chunk.  Collective over pp (and tp).
        """
        out: "OrderedDict[str, Any]" = OrderedDict()
        for s in range(self.num_stages):
            owner = s % self.pp
            chunk = self.chunks[s]
            if owner == self.rank:
                arrays = gather_full_state(chunk)
            else:
                arrays = OrderedDict()
                for n, p in chunk.named_parameters():
                    arrays[n] = array_module(p.data).empty(p.shape, dtype=p.dtype)
            for n in sorted(arrays):
                if self.pp > 1:
                    self.comm.broadcast(arrays[n], root=owner)
                out[n] = arrays[n]
        return out

    # ---------------------------------------------------------------- shapes
    def reset_shapes(self) -> None:
        self._shapes, self._in_key, self._recvs = None, None, None
        if self._shared is not None:  # its window is freed at the next step, once every rank is known there
            self._stale_shared, self._shared = self._shared, None
        if self._spin_setting == "auto":
            self.spin_after_send = None  # measured again, for the new message sizes

    def _receive_plan(self) -> list[Receive]:
        """``(shape, dtype, peer, tag, inbox key, label)`` of this rank's receive actions in order (once per
        shapes); the label names the receive in errors.

        Inbox keys: forward inputs by the consuming stage, backward gradients by the producing stage.
        """
        if self._recvs is None:
            messages = self._messages()
            plan = []
            for a in self.actions:
                if a.is_recv:
                    tag, shape, dtype = messages[a.match_key()]
                    what = "activation into" if a.kind == RECV_F else "gradient from"
                    label = (f"pipeline: receive of the {what} stage {a.stage} of micro-batch {a.microbatch} from "
                             f"rank {a.peer} (tag {tag})")
                    key = (F, a.stage, a.microbatch) if a.kind == RECV_F else (B, a.stage + 1, a.microbatch)
                    plan.append((shape, dtype, a.peer, tag, key, label))
            self._recvs = plan
        return self._recvs

    def _messages(self) -> dict[tuple[str, int, int], tuple[int, tuple, Any]]:
        """Match key -> ``(tag, shape, dtype)`` of every message this rank sends or receives in a step: a stage's
        input comes in and its gradient goes back; its output goes on and the output's gradient comes back."""
        assert self._shapes is not None, "the shapes are inferred first"
        out = {}
        for a in self.actions:
            if not a.is_compute:
                in_shape, in_dtype, out_shape, out_dtype = self._shapes[a.stage]
                shape, dtype = (in_shape, in_dtype) if a.kind in (RECV_F, SEND_B) else (out_shape, out_dtype)
                out[a.match_key()] = (message_tag(a, self.num_micro_batches, self.tag_base), shape, dtype)
        return out

    def _largest_message(self) -> int:
        """Bytes of the largest activation or gradient a local stage receives or sends."""
        assert self._shapes is not None, "the shapes are inferred first"
        return max(int(np.prod(shape)) * np.dtype(dtype).itemsize
                   for in_shape, in_dtype, out_shape, out_dtype in self._shapes.values()
                   for shape, dtype in ((in_shape, in_dtype), (out_shape, out_dtype)))

    def _meta_tag(self, stage: int) -> int:
        return self.tag_base + 2 * self.num_stages * self.num_micro_batches + 2 + stage

    # ---------------------------------------------------------------- one step
    def train_step(self, x: Any = None, y: Any = None) -> float:
        """Forward and backward of the local batch in ``num_micro_batches`` micro-batches; grads accumulate.

        ``x`` is needed on the first pipeline rank, ``y`` on the last (others may pass None or the same arrays).
        Returns the mean loss over the batch, identical on every pipeline rank.
        """
        t_start = time.perf_counter()
        self._steps_called += 1  # first, so that a step that fails anywhere still counts alike on every rank
        xs = self._split(x, "x") if 0 in self.stages else None
        ys = self._split(y, "y") if (self.num_stages - 1) in self.stages else None
        executor = self._executor(xs)
        # parameters whose .grad is None (zero_grad(set_to_none=True)): their first backward would allocate (and
        # page-fault in) fresh grad arrays on the critical path; materialise them while blocked in a receive instead
        pending_grads = [p for p in self.parameters() if p.grad is None] if self.pp > 1 else []
        trace = self.trace if self.trace is not None or not self.comm.recording_timeline else []
        state = StepState(xs or [], ys or [], pending_grads, trace)
        executor.run(state, self._program)
        return self._finish_step(state, t_start)

    def prepare(self, x: Any = None) -> None:
        """What the first step (or the first after :meth:`reset_shapes`) sets up before computing — the shapes
        handshake, the hand-offs' transports, the send-progress measurement — done now (collective over the
        pipeline ranks; ``x`` as for :meth:`train_step`), so that a timed step holds only its own work.
        :meth:`train_step` does it when it was not done."""
        self._set_up(self._split(x, "x") if 0 in self.stages else None)

    def _executor(self, xs: list | None) -> StepExecutor:
        """This step's executor, after the set-up (:meth:`prepare`) where it is still to do."""
        self._set_up(xs)
        if self._shared is not None:
            self._shared.begin_step(self._steps_called)
        return StepExecutor(self.chunks, num_stages=self.num_stages, pp=self.pp, rank=self.rank,
                            num_micro_batches=self.num_micro_batches, loss_fn=self.loss_fn, recompute=self.recompute,
                            xp=chunk_array_module(self.chunks[self.stages[0]]), wire=self._wire, shared=self._shared,
                            spin=self.spin_after_send or 0.0, receives=self._receive_plan(), max_posted=self.max_posted_recvs)

    def _set_up(self, xs: list | None) -> None:
        """The shapes handshake, the hand-offs' transports and the send-progress measurement, where not done."""
        key = None
        if xs is not None:
            key = (tuple(xs[0].shape), np.dtype(xs[0].dtype).str)
            if self._shapes is not None and key != self._in_key:
                raise ConfigError(f"pipeline micro-batch shape changed from {self._in_key} to {key}; call "
                                  f"reset_shapes() on every rank first")
        if self._shapes is None:
            self._shapes = infer_shapes(self.comm, self.chunks, self.stages, self.num_stages,
                                        xs[0] if xs is not None else None, self._meta_tag)
            self._in_key = key
            if self.pp > 1 and self._wire is None:
                self._wire = self.comm.protocol_transport("pipeline")
        wire = self._wire
        if wire is not None and self._shared is None:
            host = all(chunk_array_module(self.chunks[s]) is np for s in self.stages)
            self._shared = SharedHandoffs(wire, self._all_actions, self._messages(), self.shared_memory and host,
                                          replacing=self._stale_shared)
            self._stale_shared = None
        shared = self._shared
        if self.spin_after_send is None:  # only MPI's hand-offs may need it
            self.spin_after_send = 0.0
            if wire is not None and shared is not None and not shared.all_shared:
                first_free_tag = self.tag_base + 2 * self.num_stages * self.num_micro_batches  # above the data tags
                self.spin_after_send = measure_spin_after_send(self.comm, wire, self._largest_message(), first_free_tag)

    def _finish_step(self, state: StepState, t_start: float) -> float:
        """The mean loss, broadcast from the last stage; the step's timing recorded."""
        leftovers = state.leftovers()
        if leftovers:  # pragma: no cover - would be a schedule bug
            raise RuntimeError(f"pipeline rank {self.rank}: step ended with leftovers {leftovers}")
        loss = np.array([state.loss_sum / self.num_micro_batches], dtype=np.float64)
        if self.pp > 1:
            self.comm.broadcast(loss, root=(self.num_stages - 1) % self.pp)
        if state.trace is not None:
            state.trace.append(("bcast", state.drained_at, time.perf_counter()))
            state.trace.insert(0, ("start", t_start, t_start))
            self.comm.add_spans([(f"pipeline {label}", t0, t1) for label, t0, t1 in state.trace if t1 > t0])
        total = time.perf_counter() - t_start
        self.last_timing = {"compute": state.compute_seconds, "comm_wait": state.wait_seconds,
                            "bubble": total - state.compute_seconds, "total": total,
                            "forward": state.forward_seconds, "backward": state.backward_seconds}
        for k, val in self.last_timing.items():
            self.timing[k] = self.timing.get(k, 0.0) + val
        self.timing["steps"] += 1
        return float(loss[0])

    def _split(self, a, what: str) -> list:
        if a is None:
            raise ValueError(f"PipelineParallel.train_step: {what} is required on pipeline rank {self.rank}")
        m = self.num_micro_batches
        if a.shape[0] % m:
            raise ConfigError(f"batch size % num_micro_batches == 0 is required, but {what} has {a.shape[0]} rows "
                              f"and num_micro_batches = {m}")
        k = a.shape[0] // m
        return [a[i * k:(i + 1) * k] for i in range(m)]

    def __repr__(self) -> str:
        return (f"PipelineParallel(rank {self.rank}/{self.pp}, schedule={self.schedule_name!r}, v={self.v}, "
                f"m={self.num_micro_batches}, stages={self.stages}, layers={[self.bounds[s] for s in self.stages]}, "
                f"recompute={self.recompute})")


def _tag_upper_bound(comm) -> int | None:
    try:
        ub = comm.mpi.Get_attr(MPI.TAG_UB)
        return int(ub) if ub is not None else None
    except Exception:
        return None
