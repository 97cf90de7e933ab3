"""One pipeline step: a rank's action list run by one handler per action kind over an explicit step state.

:class:`StepExecutor` holds what is fixed for the step (chunks, transports, receive plan); :class:`StepState` holds
what the step has in flight. Why receives are posted ahead and chores wait for a blocked receive: docs/pipeline.md.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any, Callable, Sequence

from mpcomm.nn.backend import array_module
from mpcomm.staging import for_buffers
from mpcomm.transport import Transport, cancel, completed

from .schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, message_tag
from .send_progress import test_until
from .shared_handoff import SharedHandoffs

# (kind, stage, micro-batch, peer, MPI tag, outbox key, trace label) of one action, decided once per engine
Instruction = tuple[str, int, int, Any, Any, Any, str]
# (shape, dtype, peer, tag, inbox key, error label) of one receive action, decided once per activation shapes
Receive = tuple[tuple, Any, int, int, tuple[str, int, int], str]


def instruction(a: Action, num_micro_batches: int, tag_base: int) -> Instruction:
    """The fields of action ``a`` the step reads, so that it calls neither the action's properties nor
    :func:`message_tag` at a hand-off (each Python call costs microseconds right after a stage's matmuls).
    A receive's tag and key are in the receive plan."""
    if a.is_recv:
        return (a.kind, a.stage, a.microbatch, a.peer, None, None, f"W{a.kind}{a.stage}.{a.microbatch}")
    label = f"{a.kind}{a.stage}.{a.microbatch}"
    if a.is_send:
        return (a.kind, a.stage, a.microbatch, a.peer, message_tag(a, num_micro_batches, tag_base),
                (a.kind[-1], a.stage, a.microbatch), label)
    return (a.kind, a.stage, a.microbatch, None, None, None, label)


@dataclass(eq=False, slots=True)
class StepState:
    """What one step has in flight, and its sums."""

    xs: list  # the micro-batches of x (where stage 0 is local) and of y (where the last stage is)
    ys: list
    pending_grads: list  # parameters whose grad is materialised while this rank is blocked in a receive
    trace: list | None  # (label, t0, t1) per action, or None
    # (request, transport, buffer, peer, tag, inbox key, label) of posted receives, in list order; request None:
    # the message comes through the node's shared memory (transport: the SharedHandoffs)
    posted: deque = field(default_factory=deque)
    next_post: int = 0  # index into the receive plan of the next receive to post
    sends: list = field(default_factory=list)  # (request, transport, data, peer) of sends in flight
    inbox: dict = field(default_factory=dict)  # (F|B, stage, micro-batch) -> received or local input
    ctxs: dict = field(default_factory=dict)  # (stage, micro-batch) -> forward context (or input, recompute)
    outbox: dict = field(default_factory=dict)  # data produced, waiting for its SEND action
    loss_sum: float = 0.0
    forward_seconds: float = 0.0  # compute: forward and loss
    backward_seconds: float = 0.0  # compute: backward, with the re-run forward of recompute
    wait_seconds: float = 0.0
    drained_at: float = 0.0  # perf_counter when the last send completed

    @property
    def compute_seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds

    def leftovers(self) -> str:
        """What a finished step still holds (empty when the schedule was consistent)."""
        held = {"posted": list(self.posted), "inbox": list(self.inbox), "ctxs": list(self.ctxs),
                "outbox": list(self.outbox)}
        return " ".join(f"{name}={keys}" for name, keys in held.items() if keys)


class StepExecutor:
    """Runs one rank's program for one step: :meth:`forward`, :meth:`backward`, :meth:`send` and :meth:`receive`
    are the handlers of the schedule's action kinds."""

    __slots__ = ("chunks", "last_stage", "pp", "rank", "grad_scale", "loss_fn", "recompute", "xp", "wire", "shared",
                 "spin", "shared_in", "shared_out", "receives", "limit")

    def __init__(self, chunks: Sequence[Any], *, num_stages: int, pp: int, rank: int, num_micro_batches: int,
                 loss_fn: Callable, recompute: bool, xp: Any, wire: Transport | None,
                 shared: SharedHandoffs | None, spin: float, receives: list[Receive], max_posted: int | None):
        self.chunks, self.last_stage, self.pp, self.rank = chunks, num_stages - 1, pp, rank
        self.grad_scale = 1.0 / num_micro_batches  # loss gradients so that accumulated grads are the batch mean's
        self.loss_fn, self.recompute, self.xp = loss_fn, recompute, xp
        self.wire, self.shared, self.spin = wire, shared, spin
        self.shared_in = shared.incoming if shared is not None else {}
        self.shared_out = shared.outgoing if shared is not None else {}
        self.receives = receives
        self.limit = len(receives) if max_posted is None else max_posted

    def run(self, st: StepState, program: Sequence[Instruction]) -> None:
        """Every action of ``program`` in order, then the wait for the sends still in flight."""
        # a local table, not an attribute: bound methods kept on self would make a cycle that holds this step's
        # views of the shared-memory window until the garbage collector runs
        handlers: dict[str, Callable[..., None]] = {F: self.forward, B: self.backward, SEND_F: self.send,
                                                    SEND_B: self.send, RECV_F: self.receive, RECV_B: self.receive}
        self.post(st, self.limit)
        try:
            for kind, s, mb, peer, tag, key, label in program:
                handlers[kind](st, s, mb, peer, tag, key, label)
        except BaseException:  # a receive left posted would take this executor's next message
            for request, *_ in st.posted:
                if request is not None:
                    cancel(request)
            raise
        self.drain(st)

    # ---------------------------------------------------------------- compute
    def forward(self, st: StepState, s: int, mb: int, peer: None, tag: None, key: None, label: str) -> None:
        """Chunk forward of micro-batch ``mb``; on the last stage also its loss and the loss gradient."""
        chunk = self.chunks[s]
        t0 = perf_counter()
        inp = st.xs[mb] if s == 0 else st.inbox.pop((F, s, mb))
        out, ctx = chunk.forward(inp)
        if s == self.last_stage:
            loss, g = self.loss_fn(out, st.ys[mb])
            st.loss_sum += float(loss)
            st.inbox[(B, s + 1, mb)] = g * self.grad_scale
        elif (s + 1) % self.pp == self.rank:
            st.inbox[(F, s + 1, mb)] = out
        else:
            st.outbox[(F, s, mb)] = out
        st.ctxs[(s, mb)] = inp if self.recompute else ctx
        t1 = perf_counter()
        st.forward_seconds += t1 - t0
        if st.trace is not None:
            st.trace.append((label, t0, t1))

    def backward(self, st: StepState, s: int, mb: int, peer: None, tag: None, key: None, label: str) -> None:
        """Chunk backward of micro-batch ``mb`` with its output's gradient (re-running the forward with
        recompute); the input gradient goes to the previous stage."""
        chunk = self.chunks[s]
        t0 = perf_counter()
        gy = st.inbox.pop((B, s + 1, mb))
        ctx = st.ctxs.pop((s, mb))
        if self.recompute:
            _, ctx = chunk.forward(ctx)
        gx = chunk.backward(gy, ctx)
        if s > 0:
            if (s - 1) % self.pp == self.rank:
                st.inbox[(B, s, mb)] = gx
            else:
                st.outbox[(B, s, mb)] = gx
        t1 = perf_counter()
        st.backward_seconds += t1 - t0
        if st.trace is not None:
            st.trace.append((label, t0, t1))

    # ---------------------------------------------------------------- hand-offs
    def send(self, st: StepState, s: int, mb: int, peer: int, tag: int, key: tuple, label: str) -> None:
        """Start the send of an activation or gradient: into the receiver's shared memory, or an MPI isend kept
        in ``st.sends`` until it completes."""
        t0 = perf_counter()
        if tag in self.shared_out:
            assert self.shared is not None  # shared_out is its table
            self.shared.send(tag, st.outbox.pop(key))
        else:
            data = self.xp.ascontiguousarray(st.outbox.pop(key))
            t = for_buffers(self.wire, "send", data)
            request = t.isend(data, peer, tag)
            if self.spin:  # MPI moves the message only while this rank calls it (see send_progress)
                test_until(request, perf_counter() + self.spin)
            st.sends.append((request, t, data, peer))
        if st.trace is not None:
            st.trace.append((label, t0, perf_counter()))

    def receive(self, st: StepState, s: int, mb: int, peer: int, tag: None, key: None, label: str) -> None:
        """Wait for the next posted receive; while its message has not arrived, do the step's chores (post
        later receives, complete finished sends, materialise gradients)."""
        if not st.posted:
            self.post(st, 1)
        request, t, buf, peer, tag, key, error_label = st.posted.popleft()
        t0 = perf_counter()
        done = partial(completed, request) if request is not None else partial(t.arrived, tag)
        if not done():
            self.post(st, self.limit - len(st.posted))
            st.sends = _unfinished(st.sends)
            while st.pending_grads and not done():
                _materialize_grad(st.pending_grads.pop())
        if request is None:
            buf = t.receive(tag, peer, error_label)
        else:
            t.wait([request], (peer,), (buf.nbytes,), operation=error_label)
        t1 = perf_counter()
        st.wait_seconds += t1 - t0
        st.inbox[key] = buf
        if st.trace is not None:
            st.trace.append((label, t0, t1))

    def post(self, st: StepState, count: int) -> None:
        """Post up to ``count`` more receives of the plan, in order."""
        receives, posted = self.receives, st.posted
        while count > 0 and st.next_post < len(receives):
            shape, dtype, peer, tag, key, label = receives[st.next_post]
            if tag in self.shared_in:  # nothing to post: its sender raises a flag in this rank's shared memory
                posted.append((None, self.shared, None, peer, tag, key, label))
            else:
                buf = self.xp.empty(shape, dtype=dtype)
                t = for_buffers(self.wire, "recv", buf)
                posted.append((t.irecv(buf, peer, tag), t, buf, peer, tag, key, label))
            st.next_post += 1
            count -= 1

    def drain(self, st: StepState) -> None:
        """Wait for every send still in flight (its buffer must live until then)."""
        t0 = perf_counter()
        for request, t, _, peer in st.sends:
            t.wait([request], (peer,), operation="pipeline send")
        t1 = perf_counter()
        st.wait_seconds += t1 - t0
        st.drained_at = t1
        if st.trace is not None:
            st.trace.append(("drain", t0, t1))


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


def _materialize_grad(p: Any) -> None:
    """``p.grad`` <- touched zeros of ``p``'s shape (same result as allocating on first accumulation)."""
    if p.grad is None:
        g = array_module(p.data).empty(p.data.shape, dtype=p.data.dtype)
        g[...] = 0
        p.grad = g
