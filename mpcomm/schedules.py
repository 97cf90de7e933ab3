"""Pipeline schedules as data (pure Python, no MPI).

The shape follows ``torch.distributed.pipelining``: a schedule is, for each pipeline rank, a list of small
:class:`Action` values.  Three short functions produce the *compute* lists (:func:`gpipe`,
:func:`one_f_one_b`, :func:`interleaved_one_f_one_b`); a separate pass, :func:`with_communication`, inserts the
point-to-point actions; :func:`check_deadlock_free` proves a list can be executed; :func:`simulate_timeline`
measures its bubble so it can be compared with :func:`bubble_fraction_theory`.

Stages
------
With ``pp`` ranks and ``v`` virtual stages (model chunks) per rank there are ``S = pp * v`` stages.  Rank ``r``
holds stages ``r, r + pp, ..., r + (v - 1) * pp`` (Megatron's interleaved placement); so stage ``s`` lives on rank
``s % pp`` and chunk ``s // pp``.  With ``v == 1`` the stage index is the rank.

Execution model (what an executor must do, and what :func:`check_deadlock_free` simulates)
------------------------------------------------------------------------------------------
Each rank walks its own list front to back:

* ``F`` / ``B``: run the forward / backward of that stage for that micro-batch (local, never blocks).
* ``SEND_F`` / ``SEND_B``: *post* a non-blocking send (``isend``) of the activation / input-gradient just
  produced and go on at once.  The send buffer must stay alive until the request completes; the executor keeps
  the requests and waits for all of them at the end of the step (or whenever convenient) - never at the point of
  posting.
* ``RECV_F`` / ``RECV_B``: a *blocking* receive; the rank waits until the matching message has arrived.

Messages are matched by :meth:`Action.match_key` (equivalently :func:`message_tag`), not by arrival order: the
executor must use a distinct tag per (direction, edge, micro-batch).  ``SEND_F`` of stage ``s`` matches ``RECV_F``
of stage ``s + 1``; ``SEND_B`` of stage ``s`` matches ``RECV_B`` of stage ``s - 1`` (same micro-batch).

:func:`with_communication` puts every receive immediately before the compute action that consumes it and every
send immediately after the compute action that produces it.  Under the model above a receive therefore waits
exactly for the producing compute action on the peer, so the list is deadlock-free iff the compute order is
consistent with the data dependencies - which is what the checker verifies.  (With *blocking* sends the same
1F1B lists can deadlock in the steady state - both neighbours sending at once - which is why sends are posted
non-blocking.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, Union

from mpcomm.errors import ConfigError, MpcommError

__all__ = [
    "Action", "F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "COMPUTE_KINDS", "COMM_KINDS",
    "ScheduleError", "DeadlockError",
    "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "schedule", "SCHEDULES",
    "with_communication", "check_deadlock_free", "message_tag", "peak_in_flight",
    "Timeline", "simulate_timeline", "bubble_fraction", "bubble_fraction_theory", "format_timeline",
]

F, B = "F", "B"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_KINDS = frozenset({F, B})
COMM_KINDS = frozenset({SEND_F, RECV_F, SEND_B, RECV_B})


class ScheduleError(MpcommError):
    """A schedule is malformed (missing / duplicated / out-of-order actions, unmatched messages)."""


class DeadlockError(ScheduleError):
    """Executing the schedule under the documented model gets stuck; the message shows every rank's state."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule.

    ``stage`` is the (virtual) stage the action belongs to - for comm actions the *local* stage, i.e. the stage
    whose output is sent (``SEND_*``) or whose input is received (``RECV_*``).  ``peer`` is the other rank of a
    comm action (``None`` for compute).
    """

    stage: int
    kind: str
    microbatch: int
    peer: int | None = None

    def __post_init__(self):
        if self.kind not in COMPUTE_KINDS and self.kind not in COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of F, B, SEND_F, RECV_F, SEND_B, RECV_B")
        if self.kind in COMM_KINDS and self.peer is None:
            raise ValueError(f"communication action {self.kind} needs a peer rank")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in (SEND_F, SEND_B)

    @property
    def is_recv(self) -> bool:
        return self.kind in (RECV_F, RECV_B)

    def match_key(self) -> tuple[str, int, int]:
        """``(direction, source stage, microbatch)`` shared by a send and the receive that matches it."""
        if self.kind in (SEND_F, SEND_B):
            return (self.kind[-1], self.stage, self.microbatch)
        if self.kind == RECV_F:
            return (F, self.stage - 1, self.microbatch)
        if self.kind == RECV_B:
            return (B, self.stage + 1, self.microbatch)
        raise ValueError(f"{self} is not a communication action")

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.stage}{self.kind}{self.microbatch}"
        arrow = "->" if self.is_send else "<-"
        return f"{self.kind}(s{self.stage},m{self.microbatch}){arrow}r{self.peer}"


def message_tag(action: Action, num_microbatches: int, tag_base: int = 0) -> int:
    """A distinct, non-negative MPI tag for the message of a comm action (same on sender and receiver)."""
    direction, src_stage, mb = action.match_key()
    return tag_base + 2 * (src_stage * num_microbatches + mb) + (0 if direction == F else 1)


# ----------------------------------------------------------------------------------------------- validation

def _check_sizes(pp: int, m: int, v: int = 1) -> None:
    for name, val in (("pp", pp), ("num_micro_batches", m), ("virtual_stages", v)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ConfigError(f"{name} must be a positive integer, got {val!r}")


# ------------------------------------------------------------------------------------- compute schedules

def gpipe(pp: int, m: int) -> list[list[Action]]:
    """GPipe: every rank runs all forwards, then all backwards (micro-batch order 0..m-1 both times)."""
    _check_sizes(pp, m)
    return [[Action(r, F, i) for i in range(m)] + [Action(r, B, i) for i in range(m)] for r in range(pp)]


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush): ``min(pp - r - 1, m)`` warm-up forwards, steady one-forward-one-backward, cool-down."""
    _check_sizes(pp, m)
    lists = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        acts = [Action(r, F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts.append(Action(r, F, warmup + i))
            acts.append(Action(r, B, i))
        acts.extend(Action(r, B, i) for i in range(m - warmup, m))
        lists.append(acts)
    return lists


def interleaved_one_f_one_b(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``).

    Rank ``r`` holds stages ``r + c * pp`` for chunks ``c < v``.  Its ``m * v`` forward "virtual micro-batches"
    ``k`` go through micro-batches in groups of ``pp``: ``chunk = (k % (pp * v)) // pp`` and
    ``microbatch = (k // (pp * v)) * pp + k % pp``; backwards use the same order with the chunk reversed.
    Warm-up: ``min((pp - r - 1) * 2 + (v - 1) * pp, m * v)`` forwards, or all ``m * v`` when ``m == pp``
    (Megatron's special case); then ``F(k + warmup), B(k)`` pairs; then the remaining backwards.
    Requires ``m % pp == 0`` and ``m >= pp`` (:class:`ConfigError` otherwise).
    """
    _check_sizes(pp, m, v)
    if m < pp or m % pp:
        raise ConfigError(
            f"interleaved-1f1b needs num_micro_batches >= pp and num_micro_batches % pp == 0 "
            f"(micro-batches go through the pipeline in groups of pp); got num_micro_batches={m}, pp={pp}")
    total = m * v
    group = pp * v

    def action(r: int, k: int, forward: bool) -> Action:
        chunk = (k % group) // pp
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // group) * pp + k % pp
        return Action(chunk * pp + r, F if forward else B, mb)

    lists = []
    for r in range(pp):
        if m == pp:
            warmup = total
        else:
            warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
        acts = [action(r, k, True) for k in range(warmup)]
        for k in range(total - warmup):
            acts.append(action(r, k + warmup, True))
            acts.append(action(r, k, False))
        acts.extend(action(r, k, False) for k in range(total - warmup, total))
        lists.append(acts)
    return lists


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def schedule(name: str, pp: int, m: int, v: int = 1) -> list[list[Action]]:
    """Compute lists for a schedule given by name: ``"gpipe"``, ``"1f1b"`` or ``"interleaved-1f1b"``."""
    if name == "gpipe":
        if v != 1:
            raise ConfigError(f"virtual_stages={v} > 1 requires schedule 'interleaved-1f1b', not 'gpipe'")
        return gpipe(pp, m)
    if name == "1f1b":
        if v != 1:
            raise ConfigError(f"virtual_stages={v} > 1 requires schedule 'interleaved-1f1b', not '1f1b'")
        return one_f_one_b(pp, m)
    if name == "interleaved-1f1b":
        return interleaved_one_f_one_b(pp, m, v)
    raise ConfigError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULES)}")


# ------------------------------------------------------------------------------------------ communication

def _shape(lists: Sequence[Sequence[Action]], pp: int | None, v: int | None) -> tuple[int, int]:
    pp = len(lists) if pp is None else pp
    if len(lists) != pp:
        raise ScheduleError(f"got {len(lists)} per-rank lists for pp={pp}")
    if v is None:
        max_stage = max((a.stage for acts in lists for a in acts), default=pp - 1)
        v = max_stage // pp + 1
    return pp, v


def with_communication(compute_lists: Sequence[Sequence[Action]], pp: int | None = None,
                       v: int | None = None) -> list[list[Action]]:
    """Insert ``RECV_*`` right before and ``SEND_*`` right after each compute action whose data crosses ranks.

    ``F`` of stage ``s > 0`` receives its input from the rank of stage ``s - 1``; ``F`` of stage ``s < S - 1``
    sends its output to the rank of stage ``s + 1``; ``B`` of stage ``s < S - 1`` receives the output gradient from
    the rank of stage ``s + 1``; ``B`` of stage ``s > 0`` sends the input gradient to the rank of stage ``s - 1``.
    Neighbouring stages on the same rank (``pp == 1`` with ``v > 1``) exchange nothing.  See the module docstring
    for the execution model under which the result is deadlock-free.
    """
    pp, v = _shape(compute_lists, pp, v)
    last = pp * v - 1
    out = []
    for r, acts in enumerate(compute_lists):
        new: list[Action] = []
        for a in acts:
            if not a.is_compute:
                raise ScheduleError(f"rank {r}: with_communication expects compute actions only, got {a}")
            s, mb = a.stage, a.microbatch
            if a.kind == F:
                if s > 0 and (s - 1) % pp != r:
                    new.append(Action(s, RECV_F, mb, peer=(s - 1) % pp))
                new.append(a)
                if s < last and (s + 1) % pp != r:
                    new.append(Action(s, SEND_F, mb, peer=(s + 1) % pp))
            else:
                if s < last and (s + 1) % pp != r:
                    new.append(Action(s, RECV_B, mb, peer=(s + 1) % pp))
                new.append(a)
                if s > 0 and (s - 1) % pp != r:
                    new.append(Action(s, SEND_B, mb, peer=(s - 1) % pp))
        out.append(new)
    return out


def _has_comm(lists: Sequence[Sequence[Action]]) -> bool:
    return any(not a.is_compute for acts in lists for a in acts)


def check_deadlock_free(lists: Sequence[Sequence[Action]], pp: int | None = None, v: int | None = None,
                        num_microbatches: int | None = None) -> bool:
    """Simulate the execution model of the module docstring; return ``True`` or raise.

    Checks, while executing: every compute action runs on the rank owning its stage; ``F(s, m)`` runs after
    ``F(s-1, m)`` and, when that is on another rank, after receiving it; ``B(s, m)`` runs after ``F(s, m)`` on the
    same rank and after ``B(s+1, m)`` (received when remote); a send follows the compute that produced its data
    and goes to the rank that owns the neighbouring stage; every send is matched by exactly one receive with the
    same :meth:`Action.match_key`.  At the end: every ``(stage, microbatch)`` has exactly one ``F`` and one ``B``.

    Raises :class:`DeadlockError` (showing each rank's position and what it waits for) when no rank can move,
    :class:`ScheduleError` for any other violation.
    """
    pp, v = _shape(lists, pp, v)
    S = pp * v
    if num_microbatches is None:
        num_microbatches = max((a.microbatch for acts in lists for a in acts), default=-1) + 1
    M = num_microbatches
    done: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> rank that ran it
    posted: dict[tuple[str, int, int], int] = {}  # match key -> sending rank (not yet received)
    received: set[tuple[str, int, int]] = set()  # match keys consumed by a receive
    got: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]  # match keys received on each rank
    pc = [0] * pp

    def fail(r: int, a: Action, why: str) -> None:
        raise ScheduleError(f"rank {r}, action #{pc[r]} {a}: {why}")

    def step(r: int) -> bool:
        a = lists[r][pc[r]]
        s, mb = a.stage, a.microbatch
        if not (0 <= s < S) or not (0 <= mb < M):
            fail(r, a, f"stage must be in [0, {S}) and microbatch in [0, {M})")
        if a.is_compute:
            if s % pp != r:
                fail(r, a, f"stage {s} lives on rank {s % pp}, not rank {r}")
            key = (a.kind, s, mb)
            if key in done:
                fail(r, a, f"duplicate {a.kind} for stage {s}, microbatch {mb}")
            if a.kind == F:
                if s > 0:
                    if (F, s - 1, mb) not in done:
                        fail(r, a, f"runs before its input F of stage {s - 1} (microbatch {mb}) was computed")
                    if (s - 1) % pp != r and (F, s - 1, mb) not in got[r]:
                        fail(r, a, f"input from rank {(s - 1) % pp} (stage {s - 1}) was never received (missing RECV_F)")
            else:
                if (F, s, mb) not in done:
                    fail(r, a, f"backward runs before the forward F of stage {s}, microbatch {mb}")
                if s < S - 1:
                    if (B, s + 1, mb) not in done:
                        fail(r, a, f"runs before the gradient B of stage {s + 1} (microbatch {mb}) was computed")
                    if (s + 1) % pp != r and (B, s + 1, mb) not in got[r]:
                        fail(r, a, f"gradient from rank {(s + 1) % pp} (stage {s + 1}) was never received (missing RECV_B)")
            done[key] = r
            return True
        if s % pp != r:
            fail(r, a, f"stage {s} lives on rank {s % pp}, not rank {r}")
        key = a.match_key()
        if a.is_send:
            nb = s + 1 if a.kind == SEND_F else s - 1
            if not (0 <= nb < S) or a.peer != nb % pp:
                fail(r, a, f"must go to the rank of stage {nb} ({nb % pp if 0 <= nb < S else 'none'})")
            if (a.kind[-1], s, mb) not in done:
                fail(r, a, f"sends data before {a.kind[-1]} of stage {s}, microbatch {mb} was computed")
            if key in posted or key in received:
                fail(r, a, "duplicate send (a receive can match only one)")
            posted[key] = r
            return True
        # receive: blocks until the matching send was posted
        src_stage = key[1]
        if not (0 <= src_stage < S) or a.peer != src_stage % pp:
            fail(r, a, f"must come from the rank of stage {src_stage}")
        if key in received:
            fail(r, a, "duplicate receive (its send was already consumed)")
        if key not in posted:
            return False
        del posted[key]
        received.add(key)
        got[r].add(key)
        return True

    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pc[r] < len(lists[r]) and step(r):
                pc[r] += 1
                progress = True
    if any(pc[r] < len(lists[r]) for r in range(pp)):
        lines = []
        for r in range(pp):
            if pc[r] >= len(lists[r]):
                lines.append(f"  rank {r}: finished ({len(lists[r])} actions)")
            else:
                a = lists[r][pc[r]]
                lines.append(f"  rank {r}: blocked at action #{pc[r]} {a}, waiting for rank {a.peer} to post "
                             f"the matching send ({'SEND_F' if a.kind == RECV_F else 'SEND_B'} of stage "
                             f"{a.match_key()[1]}, microbatch {a.microbatch})")
        raise DeadlockError("schedule deadlocks (sends non-blocking, receives blocking):\n" + "\n".join(lines))
    if posted:
        raise ScheduleError("sends never received: " + ", ".join(
            f"{d}{s}{m} from rank {r}" for (d, s, m), r in sorted(posted.items())))
    missing = [f"{k}{s}{mb}" for k in (F, B) for s in range(S) for mb in range(M) if (k, s, mb) not in done]
    if missing:
        raise ScheduleError(f"missing compute actions (stage, microbatch): {' '.join(missing[:20])}"
                            + (" ..." if len(missing) > 20 else ""))
    return True


def peak_in_flight(compute_lists: Sequence[Sequence[Action]]) -> list[int]:
    """Per rank, the largest number of (stage, microbatch) activations alive at once (F done, B not yet)."""
    peaks = []
    for acts in compute_lists:
        live = peak = 0
        for a in acts:
            if a.kind == F:
                live += 1
                peak = max(peak, live)
            elif a.kind == B:
                live -= 1
        peaks.append(peak)
    return peaks


# ------------------------------------------------------------------------------------------------ timeline

Duration = Union[float, Callable[[Action], float]]


@dataclass
class Timeline:
    """Result of :func:`simulate_timeline`: ``events[r]`` are ``(start, end, action)`` of rank ``r``'s computes."""

    events: list[list[tuple[float, float, Action]]]
    busy: list[float]
    idle: list[float]
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ``pp x makespan`` rectangle: ``1 - sum(busy) / (pp * makespan)``."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def _dur(t: Duration, a: Action) -> float:
    return float(t(a)) if callable(t) else float(t)


def execution_order(lists: Sequence[Sequence[Action]]) -> Iterator[tuple[int, Action]]:
    """``(rank, action)`` of every rank's actions with communication in an order that can run them: each rank in
    turn as far as it can go, a receive only after its send. Stops where no rank can move (a schedule that
    :func:`check_deadlock_free` refuses)."""
    sent: set[tuple[str, int, int]] = set()
    pc = [0] * len(lists)
    moved = True
    while moved:
        moved = False
        for r, acts in enumerate(lists):
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.is_recv:
                    if a.match_key() not in sent:
                        break
                    sent.remove(a.match_key())
                elif a.is_send:
                    sent.add(a.match_key())
                yield r, a
                pc[r] += 1
                moved = True


def simulate_timeline(lists: Sequence[Sequence[Action]], t_f: Duration = 1.0, t_b: Duration = 2.0,
                      t_comm: Duration = 0.0, pp: int | None = None, v: int | None = None) -> Timeline:
    """Event simulation of a schedule under the execution model of the module docstring.

    ``t_f`` / ``t_b`` are the durations of one ``F`` / ``B`` (a number, or a function of the :class:`Action`);
    ``t_comm`` is the latency from posting a send to the data being available at the receiver.  Sends cost the
    sender nothing.  Compute-only lists get their communication inserted first.  Raises like
    :func:`check_deadlock_free` if the schedule cannot run.
    """
    pp, v = _shape(lists, pp, v)
    if not _has_comm(lists):
        lists = with_communication(lists, pp, v)
    check_deadlock_free(lists, pp, v)
    clock = [0.0] * pp
    busy = [0.0] * pp
    events: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    arrival: dict[tuple[str, int, int], float] = {}
    for r, a in execution_order(lists):
        if a.is_compute:
            d = _dur(t_f if a.kind == F else t_b, a)
            events[r].append((clock[r], clock[r] + d, a))
            clock[r] += d
            busy[r] += d
        elif a.is_send:
            arrival[a.match_key()] = clock[r] + _dur(t_comm, a)
        else:
            clock[r] = max(clock[r], arrival.pop(a.match_key()))
    makespan = max((ev[-1][1] for ev in events if ev), default=0.0)
    return Timeline(events=events, busy=busy, idle=[makespan - b for b in busy], makespan=makespan)


def bubble_fraction(lists: Sequence[Sequence[Action]], t_f: Duration = 1.0, t_b: Duration = 1.0,
                    t_comm: Duration = 0.0) -> float:
    """Simulated bubble (idle share) of a schedule; defaults to equal F and B times, as the theory assumes."""
    return simulate_timeline(lists, t_f=t_f, t_b=t_b, t_comm=t_comm).bubble_fraction


def bubble_fraction_theory(pp: int, m: int, v: int = 1) -> float:
    """The textbook bubble ``(pp - 1) / (v * m + pp - 1)`` (Narayanan et al. 2021, equal F and B per chunk)."""
    return (pp - 1) / (v * m + pp - 1)


def format_timeline(lists: Sequence[Sequence[Action]], timed: bool = False, t_f: Duration = 1.0,
                    t_b: Duration = 1.0) -> str:
    """The familiar table: one row per rank.

    ``timed=False`` lists each rank's compute actions in order (``0F0 0F1 ...``); ``timed=True`` places them on
    the simulated clock (unit step ``min`` duration, equal F and B times by default), idle slots shown as ``.``.
    """
    pp = len(lists)
    compute = [[a for a in acts if a.is_compute] for acts in lists]
    width = max((len(str(a)) for acts in compute for a in acts), default=3)
    if not timed:
        return "\n".join(f"rank {r}: " + " ".join(str(a).rjust(width) for a in acts)
                         for r, acts in enumerate(compute))
    tl = simulate_timeline(lists, t_f=t_f, t_b=t_b)
    unit = min((e - s for ev in tl.events for s, e, _ in ev if e > s), default=1.0)
    nslots = int(round(tl.makespan / unit))
    rows = []
    for r in range(pp):
        cells = [".".rjust(width)] * nslots
        for s, e, a in tl.events[r]:
            for k in range(int(round(s / unit)), int(round(e / unit))):
                cells[k] = str(a).rjust(width)
        rows.append(f"rank {r}: " + " ".join(cells))
    rows.append(f"bubble {tl.bubble_fraction:.3f} (makespan {tl.makespan:g})")
    return "\n".join(rows)
