"""Pipeline parallelism: an executor for the action lists of :mod:`mpcomm.parallel.schedules`.

``PipelineParallel(module, mesh_or_pp_comm, num_micro_batches, schedule="1f1b", virtual_stages=1)`` splits a
:class:`~mpcomm.nn.Sequential` into ``S = pp * v`` contiguous chunks (stages); pipeline rank ``r`` holds stages
``r, r + pp, ..., r + (v - 1) * pp``.  :meth:`PipelineParallel.train_step` runs forward and backward of every
micro-batch following this rank's list from ``with_communication(schedule(...))``:

* ``F``: chunk forward of micro-batch ``m`` (input: the data on stage 0, else the received / local activation);
  the functional ``ctx`` is kept per ``(stage, m)`` (with ``recompute=True`` only the chunk input is kept and the
  forward is re-run right before the backward).  On the last stage the loss of the micro-batch is computed
  (``loss_fn`` = mean over the micro-batch) and its gradient scaled by ``1/m`` so accumulated parameter gradients
  equal those of the full (local) batch mean.
* ``B``: chunk backward with the received gradient (or the loss gradient on the last stage).
* ``SEND_*``: one MPI message of the activation or gradient — its request and buffer are kept until completed
  (released while this rank waits in a receive, drained at the end of the step) — or, to a rank of the same
  node, a copy into the receiver's shared memory (below).
* ``RECV_*``: a receive into a fresh buffer of the known shape, posted ahead of time (up to ``max_posted_recvs``
  outstanding, in list order) so the transfer overlaps computation; waited only when the action is reached.

Between two ranks the critical path is "compute, isend" on one side and "receive completes, compute" on the
other, so everything else — posting later receives, releasing finished sends, faulting in gradient buffers —
is done only while this rank is blocked in a receive whose message has not arrived.

Recomputation re-runs the chunk forward as is: a layer that draws random numbers in training mode (Dropout)
would draw a new mask, so ``recompute=True`` is exact only for deterministic layers (all of the workload's).

Messages are matched by :func:`~mpcomm.parallel.schedules.message_tag`.  Activation shapes are inferred once,
at the first step, by a stage-ordered handshake: every stage runs its chunk on a zero-row input of the received
feature shape (eval mode, so no RNG advances) and sends ``(rows, *features, dtype)`` of its output to the next
stage.  Since both sides then know every message's size, hand-offs travel without mpcomm's point-to-point
envelope: one MPI message each, on the pp Communicator's private ``"pipeline"`` channel
(``Communicator._protocol_transport``), its receive posted before it is sent (the envelope cost ~35 us of a
~130 us hand-off, bench/results/pipeline_handoff.md).  Every wait keeps the Communicator's deadline, a received
size other than the expected one raises on the receiver (never a partial buffer), and a failed step cancels
the receives it left posted.  Later steps must keep the same micro-batch shape (a change raises on stage 0);
call :meth:`PipelineParallel.reset_shapes` to re-infer.

Between ranks of one node (``shared_memory=True``, the default; stages on numpy arrays) hand-offs skip MPI: at the
first step every rank exposes slots in an MPI shared-memory window (:mod:`mpcomm.parallel.shared_handoff`); a
sender copies its output into the message's slot and raises a flag, and the receiver computes on the slot in place
(a 128 KiB hand-off 35-64 us instead of 95-155 through MPI, bench/results/pipeline_handoff.md). A slot is reused
only once its receiver's backward of the micro-batch is done, whatever the timing; a node whose /dev/shm is short
of twice its window, other nodes, and device arrays go through MPI. ``shared_memory=False`` sends every hand-off
as an MPI message.

An MPI send is started and left to MPI, which on most configurations moves it while this rank computes on. Some move
a message only while its sender calls MPI (MPICH's shared memory without CMA, i.e. where yama's ``ptrace_scope`` is
not 0, as on Ubuntu): there the waiting receiver would wait for the sender's whole next compute. Where some
neighbouring ranks hand off by MPI, the first step measures which is the case (:mod:`mpcomm.parallel.send_progress`);
where it is, each send is tested until it completes, for at most ``spin_after_send`` seconds (2-10 ms; pass a
number to set it, 0 never to test), and ``self.spin_after_send`` says what was decided.

Timing per step (``self.last_timing``; running sums in ``self.timing``): ``compute`` (F/B and loss, including any
tensor-parallel collectives inside the chunks), ``comm_wait`` (blocked in receive waits and the final send
drain), ``bubble`` = ``total - compute`` (idle), ``total`` (the whole step including the loss broadcast), and
``forward`` / ``backward`` (the compute split by kind; backward includes the re-run forward with recompute).
Set ``self.trace = []`` to also record ``(label, t0, t1)`` (``time.perf_counter``) of every compute action, receive
wait (``WRECV_*``), the final send drain and the loss broadcast, for a per-rank timeline.

Gradients released by ``zero_grad(set_to_none=True)`` would be re-allocated (and page-faulted in, several ms for
large layers) inside the first backward of each step, on the critical path; with ``pp > 1`` they are instead
materialised as zeros while the rank is blocked in a receive that has not arrived yet (same values).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
from mpi4py import MPI

from mpcomm.errors import ConfigError
from mpcomm.nn import Sequential, mse_loss
from mpcomm.nn.backend import array_module
from mpcomm.staging import for_buffers
from mpcomm.transport import cancel, completed

from .schedules import (B, F, RECV_F, SCHEDULES, SEND_B, message_tag, schedule as make_schedule,
                        with_communication)
from .send_progress import measure_spin_after_send, test_until
from .shared_handoff import SharedHandoffs
from .tensor import gather_full_state

__all__ = ["PipelineParallel", "partition_layers"]

_META_LEN = 10  # dtype index, ndim, up to 8 dims
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
                "int64", "int32", "int16", "int8", "uint8", "bool")


def _dtype_index(dtype) -> int:
    name = np.dtype(dtype).name
    if name not in _DTYPE_NAMES:
        raise ConfigError(f"pipeline activations of dtype {name} are not supported; use one of {_DTYPE_NAMES}")
    return _DTYPE_NAMES.index(name)


def _dtype_of(index: int):
    name = _DTYPE_NAMES[index]
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


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

    def __init__(self, module: Sequential, mesh, num_micro_batches: int, schedule: str = "1f1b",
                 virtual_stages: int = 1, balance: Any = "layers", recompute: bool = False,
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
        self._program = [_instruction(a, num_micro_batches, tag_base) for a in self.actions]
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
        self._shapes: dict[int, tuple[tuple, Any, tuple, Any]] | None = None  # stage -> (in shape, dtype, out...)
        self._in_key = None
        self._recvs: list | None = None  # see _receive_plan
        self._wire = None  # the hand-offs' own MPI communicator (made at the first step): see train_step
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

    def _receive_plan(self) -> list[tuple[tuple, Any, int, int, tuple[str, int, int], str]]:
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

    def _infer_shapes(self, first_input) -> None:
        """Stage-ordered handshake: ``(rows, *features, dtype)`` of every local stage's input and output."""
        shapes: dict[int, tuple] = {}
        pending = []
        prev_out = None  # output meta of the previous stage when it is local (pp == 1)
        for s in self.stages:
            if s == 0:
                in_shape, in_dtype = tuple(first_input.shape), first_input.dtype
            elif (s - 1) % self.pp == self.rank:
                in_shape, in_dtype = prev_out
            else:
                meta = np.zeros(_META_LEN, dtype=np.int64)
                self.comm.recv(meta, (s - 1) % self.pp, tag=self._meta_tag(s - 1))
                in_shape, in_dtype = tuple(int(d) for d in meta[2:2 + meta[1]]), _dtype_of(int(meta[0]))
            out_shape, out_dtype = self._probe(s, in_shape, in_dtype)
            shapes[s] = (in_shape, in_dtype, out_shape, out_dtype)
            prev_out = (out_shape, out_dtype)
            if s < self.num_stages - 1 and (s + 1) % self.pp != self.rank:
                if len(out_shape) > _META_LEN - 2:
                    raise ConfigError(f"pipeline activations may have at most {_META_LEN - 2} dims, got {out_shape}")
                meta = np.zeros(_META_LEN, dtype=np.int64)
                meta[0], meta[1] = _dtype_index(out_dtype), len(out_shape)
                meta[2:2 + len(out_shape)] = out_shape
                pending.append((self.comm.isend(meta, (s + 1) % self.pp, tag=self._meta_tag(s)), meta))
        for w, _ in pending:
            w.wait()
        self._shapes = shapes

    def _messages(self) -> dict[tuple[str, int, int], tuple[int, tuple, Any]]:
        """Match key -> ``(tag, shape, dtype)`` of every message this rank sends or receives in a step: a stage's
        input comes in and its gradient goes back; its output goes on and the output's gradient comes back."""
        out = {}
        for a in self.actions:
            if not a.is_compute:
                in_shape, in_dtype, out_shape, out_dtype = self._shapes[a.stage]
                shape, dtype = (in_shape, in_dtype) if a.kind in (RECV_F, SEND_B) else (out_shape, out_dtype)
                out[a.match_key()] = (message_tag(a, self.num_micro_batches, self.tag_base), shape, dtype)
        return out

    def _largest_message(self) -> int:
        """Bytes of the largest activation or gradient a local stage receives or sends."""
        return max(int(np.prod(shape)) * np.dtype(dtype).itemsize
                   for in_shape, in_dtype, out_shape, out_dtype in self._shapes.values()
                   for shape, dtype in ((in_shape, in_dtype), (out_shape, out_dtype)))

    def _meta_tag(self, stage: int) -> int:
        return self.tag_base + 2 * self.num_stages * self.num_micro_batches + 2 + stage

    def _probe(self, s: int, in_shape: tuple, in_dtype) -> tuple[tuple, Any]:
        """Output shape of stage ``s`` for a micro-batch of ``in_shape``: run it on a zero-row input, eval mode."""
        chunk = self.chunks[s]
        xp = _xp_of(chunk)
        modes = [(m, m.training) for m in chunk.modules()]
        chunk.train(False)
        try:
            y, _ = chunk.forward(xp.zeros((0,) + tuple(in_shape[1:]), dtype=in_dtype))
        finally:
            for m, mode in modes:
                object.__setattr__(m, "training", mode)
        return (in_shape[0],) + tuple(y.shape[1:]), y.dtype

    # ---------------------------------------------------------------- one step
    def train_step(self, x: Any = None, y: Any = None) -> float:
        """Forward and backward of the local batch in ``num_micro_batches`` micro-batches; grads accumulate.

        ``x`` is needed on the first pipeline rank, ``y`` on the last (others may pass None or the same arrays).
        Returns the mean loss over the batch, identical on every pipeline rank.
        """
        t_start = time.perf_counter()
        self._steps_called += 1  # first, so that a step that fails anywhere still counts alike on every rank
        m, S, pp, r = self.num_micro_batches, self.num_stages, self.pp, self.rank
        xs = self._split(x, "x") if 0 in self.stages else None
        ys = self._split(y, "y") if (S - 1) in self.stages else None
        if xs is not None:
            key = (tuple(xs[0].shape), np.dtype(xs[0].dtype).str)
            if self._shapes is not None and key != self._in_key:
                raise ConfigError(f"pipeline micro-batch shape changed from {self._in_key} to {key}; call "
                                  f"reset_shapes() on every rank first")
        else:
            key = None
        if self._shapes is None:
            self._infer_shapes(xs[0] if xs is not None else None)
            self._in_key = key
            if pp > 1 and self._wire is None:
                self._wire = self.comm.protocol_transport("pipeline")
        xp = _xp_of(self.chunks[self.stages[0]])
        if pp > 1 and self._shared is None:
            host = all(_xp_of(self.chunks[s]) is np for s in self.stages)
            self._shared = SharedHandoffs(self._wire, self._all_actions, self._messages(), self.shared_memory and host,
                                          replacing=self._stale_shared)
            self._stale_shared = None
        shared = self._shared
        if self.spin_after_send is None:  # only MPI's hand-offs may need it
            self.spin_after_send = 0.0 if pp == 1 or shared.all_shared else measure_spin_after_send(
                self.comm, self._wire, self._largest_message(), self.tag_base + 2 * S * m)
        wire, spin = self._wire, self.spin_after_send
        if shared is not None:
            shared.begin_step(self._steps_called)
        shared_in = shared.incoming if shared is not None else {}
        shared_out = shared.outgoing if shared is not None else {}
        recvs = self._receive_plan()
        trace = self.trace
        # (request, transport, buffer, peer, tag, inbox key, label) of posted receives, in order; request None: the
        # message comes through the node's shared memory (transport: the SharedHandoffs)
        posted: deque = deque()
        next_post = 0  # index into recvs of the next receive to post
        sends: list[tuple[Any, Any, Any, int]] = []  # (request, transport, data, peer) of sends in flight
        inbox: dict[tuple[str, int, int], Any] = {}  # (F|B, stage, mb) -> received / local input
        ctxs: dict[tuple[int, int], Any] = {}
        outbox: dict[tuple[str, int, int], Any] = {}  # data produced, waiting for its SEND action
        loss_sum = 0.0
        t_compute = t_wait = 0.0
        t_kind = {F: 0.0, B: 0.0}
        limit = len(recvs) if self.max_posted_recvs is None else self.max_posted_recvs
        # parameters whose .grad is None (zero_grad(set_to_none=True)): their first backward would allocate (and
        # page-fault in) fresh grad arrays on the critical path; materialise them while blocked in a receive instead
        pending_grads = [p for p in self.parameters() if p.grad is None] if pp > 1 else []

        def post(count: int) -> None:
            nonlocal next_post
            while count > 0 and next_post < len(recvs):
                shape, dtype, peer, tag, key, label = recvs[next_post]
                if tag in shared_in:  # nothing to post: its sender raises a flag in this rank's shared memory
                    posted.append((None, shared, None, peer, tag, key, label))
                else:
                    buf = xp.empty(shape, dtype=dtype)
                    t = for_buffers(wire, "recv", buf)
                    posted.append((t.irecv(buf, peer, tag), t, buf, peer, tag, key, label))
                next_post += 1
                count -= 1

        # Everything that is not compute or a send (posting receives, releasing finished sends, faulting in grad
        # buffers) runs while this rank waits for a message that has not arrived: the critical path between two
        # ranks is then only "compute, isend" on one side and "receive completes, compute" on the other.
        post(limit)
        try:
            for op, s, mb, peer, tag, key, label in self._program:
                if op is _RECV:
                    if not posted:
                        post(1)
                    request, t, buf, peer, tag, key, error_label = posted.popleft()
                    t0 = time.perf_counter()
                    done = partial(completed, request) if request is not None else partial(t.arrived, tag)
                    if not done():
                        post(limit - len(posted))
                        sends = _unfinished(sends)
                        while pending_grads and not done():
                            _materialize_grad(pending_grads.pop())
                    if request is None:
                        buf = t.receive(tag, peer, error_label)
                    else:
                        t.wait([request], (peer,), (buf.nbytes,), operation=error_label)
                    t1 = time.perf_counter()
                    t_wait += t1 - t0
                    inbox[key] = buf
                    if trace is not None:
                        trace.append((label, t0, t1))
                    continue
                if op is _SEND:
                    t0 = time.perf_counter()
                    if tag in shared_out:
                        shared.send(tag, outbox.pop(key))
                    else:
                        data = xp.ascontiguousarray(outbox.pop(key))
                        t = for_buffers(wire, "send", data)
                        request = t.isend(data, peer, tag)
                        if spin:  # MPI moves the message only while this rank calls it (see send_progress)
                            test_until(request, time.perf_counter() + spin)
                        sends.append((request, t, data, peer))
                    if trace is not None:
                        trace.append((label, t0, time.perf_counter()))
                    continue
                chunk = self.chunks[s]
                t0 = time.perf_counter()
                if op is F:
                    inp = xs[mb] if s == 0 else inbox.pop((F, s, mb))
                    out, ctx = chunk.forward(inp)
                    if s == S - 1:
                        loss, g = self.loss_fn(out, ys[mb])
                        loss_sum += float(loss)
                        inbox[(B, s + 1, mb)] = g * (1.0 / m)
                    elif (s + 1) % pp == r:
                        inbox[(F, s + 1, mb)] = out
                    else:
                        outbox[(F, s, mb)] = out
                    ctxs[(s, mb)] = inp if self.recompute else ctx
                else:
                    gy = inbox.pop((B, s + 1, mb))
                    ctx = ctxs.pop((s, mb))
                    if self.recompute:
                        _, ctx = chunk.forward(ctx)
                    gx = chunk.backward(gy, ctx)
                    if s > 0:
                        if (s - 1) % pp == r:
                            inbox[(B, s, mb)] = gx
                        else:
                            outbox[(B, s, mb)] = gx
                t1 = time.perf_counter()
                dt = t1 - t0
                t_compute += dt
                t_kind[op] += dt
                if trace is not None:
                    trace.append((label, t0, t1))
        except BaseException:  # a receive left posted would take this executor's next message
            for request, *_ in posted:
                if request is not None:
                    cancel(request)
            raise

        t0 = time.perf_counter()
        for request, t, _, peer in sends:
            t.wait([request], (peer,), operation="pipeline send")
        t1 = time.perf_counter()
        t_wait += t1 - t0
        if self.trace is not None:
            self.trace.append(("drain", t0, t1))
        if posted or inbox or ctxs or outbox:  # pragma: no cover - would be a schedule bug
            raise RuntimeError(f"pipeline rank {r}: step ended with leftovers posted={list(posted)} "
                               f"inbox={list(inbox)} ctxs={list(ctxs)} outbox={list(outbox)}")
        loss = np.array([loss_sum / m], dtype=np.float64)
        if pp > 1:
            self.comm.broadcast(loss, root=(S - 1) % pp)
        if trace is not None:
            trace.append(("bcast", t1, time.perf_counter()))
            trace.insert(0, ("start", t_start, t_start))
        total = time.perf_counter() - t_start
        self.last_timing = {"compute": t_compute, "comm_wait": t_wait, "bubble": total - t_compute, "total": total,
                            "forward": t_kind[F], "backward": t_kind[B]}
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


_RECV, _SEND = "receive", "send"


def _instruction(a, num_micro_batches: int, tag_base: int) -> tuple:
    """``(op, stage, micro-batch, peer, MPI tag, outbox key, trace label)`` of action ``a``, decided once, so that
    the step's loop reads fields instead of calling the action's properties and :func:`message_tag` at every
    hand-off (each Python call costs microseconds right after a stage's matmuls). ``op``: F, B, ``_SEND`` or
    ``_RECV`` (a receive's tag and key are in :meth:`PipelineParallel._receive_plan`)."""
    if a.is_recv:
        return (_RECV, a.stage, a.microbatch, a.peer, None, None, f"W{a.kind}{a.stage}.{a.microbatch}")
    label = f"{a.kind}{a.stage}.{a.microbatch}"
    if a.is_send:
        return (_SEND, a.stage, a.microbatch, a.peer, message_tag(a, num_micro_batches, tag_base),
                (a.kind[-1], a.stage, a.microbatch), label)
    return (F if a.kind == F else B, a.stage, a.microbatch, None, None, None, label)


def _unfinished(sends: list) -> list:
    """The sends still in flight; a finished one is completed through its transport (which releases a staged
    device copy)."""
    out = []
    for send in sends:
        request, t, _, peer = send
        if completed(request):
            t.wait([request], (peer,), operation="pipeline send")
        else:
            out.append(send)
    return out


def _materialize_grad(p) -> None:
    """``p.grad`` <- touched zeros of ``p``'s shape (same result as allocating on first accumulation)."""
    if p.grad is None:
        g = array_module(p.data).empty(p.data.shape, dtype=p.data.dtype)
        g[...] = 0
        p.grad = g


def _xp_of(chunk):
    params = chunk.parameters()
    return array_module(params[0].data) if params else np


def _tag_upper_bound(comm) -> int | None:
    try:
        ub = comm.mpi.Get_attr(MPI.TAG_UB)
        return int(ub) if ub is not None else None
    except Exception:
        return None
