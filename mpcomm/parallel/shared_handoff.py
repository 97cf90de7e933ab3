"""Pipeline hand-offs between ranks of one node through an MPI shared-memory window.

Between two ranks that share a node, an MPI message of an activation is a copy the receiver makes when it gets to
its receive (MPICH's CMA reads the sender's pages), after MPI's rendezvous, and longer when the message waited for a
busy receiver (bench/results/pipeline_handoff.md). Here each receiving rank instead exposes slots in a window of
``MPI_Win_allocate_shared`` (MPI-3); the sender copies its output into the message's slot, with the data still in
its cache, and raises the message's flag; the receiver, seeing the flag, computes on the slot in place. One copy,
made by the sender, and no MPI call on either side; no progress of the sender needed (MPICH without CMA moves a
message only during its sender's MPI calls, see :mod:`mpcomm.parallel.send_progress`).

Slots are reused, within a step and across steps, only where that is safe whatever the timing: a slot may take
message j after message i when the receiver's last use of i (its backward of that micro-batch: a chunk's input is
kept for it, a gradient consumed by it) happens before the sender's send of j in every execution of the schedule
— Lamport's happened-before over the ranks' action lists, decided with vector clocks (Mattern 1989). With 1F1B a
link then needs about as many slots as micro-batches in flight, not one per micro-batch. A step needs no more: every
send of step k + 1 follows rank 0's step k + 1 start, which follows the end of its step k, which follows every
backward of step k. Flags are one per message and hold the number of the step that sent it.
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict
from functools import partial
from typing import Sequence, cast

import numpy as np
from mpi4py import MPI

from mpcomm.errors import MpcommError
from mpcomm.transport import Transport

from ..schedules import B, Action, execution_order

_LINE = 64  # bytes: slots and flags start on cache lines of their own (a flag: one writer, one poller)


def slot_plan(lists: Sequence[Sequence[Action]]) -> dict[tuple[str, int, int], int]:
    """Slot of every message (by :meth:`Action.match_key`) among those of its link (sender, receiver), for the
    ranks' ``lists`` with communication (:func:`~mpcomm.parallel.schedules.with_communication`): the first slot
    whose last message's use on the receiver happens before this message's send, else a new one."""
    clocks = _vector_clocks(lists)
    sends, consumers = {}, {}  # match key -> (rank, vector clock) of its send / of its receiver's backward
    links: dict[tuple[int, int | None], list] = defaultdict(list)  # (sender, receiver) -> match keys in send order
    for r, acts in enumerate(lists):
        for a, clock in zip(acts, clocks[r]):
            if a.is_send:
                sends[a.match_key()] = (r, clock)
                links[(r, a.peer)].append(a.match_key())
            elif a.is_compute and a.kind == B:
                consumers[(B, a.stage + 1, a.microbatch)] = (r, clock)  # the gradient it took from stage s + 1
                consumers[("F", a.stage - 1, a.microbatch)] = (r, clock)  # the input it kept from stage s - 1
    plan = {}
    for keys in links.values():
        last: list[tuple] = []  # per slot: the match key of its latest message
        for key in keys:
            _, clock = sends[key]
            free = [i for i, held in enumerate(last) if _happens_before(consumers[held], clock)]
            slot = free[0] if free else len(last)
            last[slot:slot + 1] = [key]
            plan[key] = slot
    return plan


def _happens_before(event: tuple[int, list[int]], clock: list[int]) -> bool:
    """Whether ``event`` (its rank and vector clock) happened before the event of vector clock ``clock``."""
    rank, own = event
    return own[rank] <= clock[rank]


def _vector_clocks(lists: Sequence[Sequence[Action]]) -> list[list[list[int]]]:
    """The vector clock of every action of every rank (a receive takes the maximum with its send's clock)."""
    pp = len(lists)
    clock = [[0] * pp for _ in range(pp)]
    out: list[list[list[int]]] = [[] for _ in range(pp)]
    sent: dict[tuple[str, int, int], list[int]] = {}
    for r, a in execution_order(lists):
        if a.is_recv:
            clock[r] = [max(x, y) for x, y in zip(clock[r], sent.pop(a.match_key()))]
        clock[r][r] += 1
        out[r].append(list(clock[r]))
        if a.is_send:
            sent[a.match_key()] = list(clock[r])
    if any(len(out[r]) < len(lists[r]) for r in range(pp)):  # pragma: no cover - the executor's are deadlock-free
        raise MpcommError("pipeline: the schedule's receives cannot all be matched")
    return out


class SharedHandoffs:
    """The hand-offs of one pipeline whose sender and receiver share a node (collective over ``wire``'s ranks).

    ``lists``: every rank's actions with communication; ``messages``: match key -> ``(tag, shape, dtype)`` of
    every message this rank sends or receives; ``host``: this rank's stages compute on numpy arrays and may hand
    off through shared memory (device buffers keep going through MPI). A link uses the window only where both
    of its ranks share a node and said ``host``; ``incoming`` / ``outgoing`` hold the tags that do. ``replacing``:
    the window of earlier shapes, freed once every rank is here.
    """

    def __init__(self, wire: Transport, lists: Sequence[Sequence[Action]], messages: dict, host: bool,
                 replacing: SharedHandoffs | None = None):
        self.wire = wire
        wire.wait([wire.mpi.Ibarrier()], wire.others)  # the calls below block: meet first, with the deadline
        node = wire.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=wire.rank)
        node_group, group = node.Get_group(), wire.mpi.Get_group()
        node_ranks = MPI.Group.Translate_ranks(group, list(range(wire.size)), node_group)
        leader = MPI.Group.Translate_ranks(node_group, [0], group)[0]
        node_group.Free()
        group.Free()
        released = replacing.release_views() if replacing is not None else True
        agreed = wire.allgather_object((leader, bool(host), released))
        everyone = [(lead, on_host) for lead, on_host, _ in agreed]
        # The earlier window goes once no rank of its node holds an array in it (unmapped memory read is a crash);
        # else it stays, held here, until MPI ends.
        self._kept = None
        if replacing is not None:
            if all(ok for lead, _, ok in agreed if lead == leader):
                replacing.free()
            else:
                self._kept = replacing
        shared = [p for p in range(wire.size) if p != wire.rank and everyone[p] == (leader, True) and host]
        plan = slot_plan(lists)
        rank = wire.rank
        mine = {key: (tag, tuple(shape), np.dtype(dtype)) for key, (tag, shape, dtype) in messages.items()}
        incoming = [(a.match_key(), a.peer) for a in lists[rank] if a.is_recv and a.peer in shared]
        outgoing = [(a.match_key(), a.peer) for a in lists[rank] if a.is_send and a.peer in shared]
        # this rank's segment: per link (by sender) its slots, each the size of the link's largest message; then
        # one flag per message
        slot_bytes: dict[int, int] = defaultdict(int)
        count: dict[int, int] = defaultdict(int)
        for key, peer in incoming:
            slot_bytes[peer] = max(slot_bytes[peer], _aligned(_nbytes(*mine[key][1:])))
            count[peer] = max(count[peer], plan[key] + 1)
        start, offset = {}, 0
        for peer in sorted(count):
            start[peer], offset = offset, offset + count[peer] * slot_bytes[peer]
        layout = {key: (start[peer] + plan[key] * slot_bytes[peer], offset + i * _LINE, _nbytes(*mine[key][1:]))
                  for i, (key, peer) in enumerate(incoming)}  # match key -> (slot offset, flag offset, bytes)
        size = offset + len(incoming) * _LINE
        published = wire.allgather_object((layout, size, _free_shared_memory()))
        layouts = [theirs for theirs, _, _ in published]
        # Every rank decides alike, for every node: does a link there go through a window, and does the node's
        # /dev/shm hold the window with room to spare (MPICH maps it there; past the end a write is a SIGBUS)?
        used = {}
        for node_leader in {lead for lead, _ in everyone}:
            here = [p for p in range(wire.size) if everyone[p][0] == node_leader]
            free = [published[p][2] for p in here if published[p][2] is not None]
            fits = not free or 2 * sum(published[p][1] for p in here) <= min(free)
            used[node_leader] = fits and any(layouts[p] for p in here)
        # whether every pair of neighbouring ranks (r, r + 1) hands off here: then no MPI message carries data
        self.all_shared = all(everyone[r] == everyone[r + 1] == (everyone[r][0], True) and used[everyone[r][0]]
                              for r in range(wire.size - 1))
        self.window = MPI.Win.Allocate_shared(size, 1, comm=cast(MPI.Intracomm, node)) if used[leader] else None
        node.Free()
        self.step = 0
        self.incoming: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # tag -> (slot, flag) in this rank's segment
        self.outgoing: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # tag -> (slot, flag) in the receiver's
        self.outgoing_keys: dict[int, tuple[str, int, int]] = {}  # tag -> match key (for errors)
        self._segments: list[np.ndarray] = []  # every array on the window's memory is a view of one of these
        if self.window is not None:
            self.window.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for the whole run, for Sync
            segments = {holder: np.frombuffer(self.window.Shared_query(node_ranks[holder])[0], dtype=np.uint8)
                        for holder in {rank, *(peer for _, peer in outgoing)}}
            for key, _ in incoming:
                self.incoming[mine[key][0]] = _views(segments[rank], layout[key], *mine[key][1:])
            for key, peer in outgoing:
                self.outgoing[mine[key][0]] = _views(segments[peer], layouts[peer][key], *mine[key][1:])
                self.outgoing_keys[mine[key][0]] = key
            segments[rank][offset:] = 0  # no flag raised (MPI does not promise zeroed memory)
            self.window.Sync()
            self._segments = list(segments.values())
        wire.wait([wire.mpi.Ibarrier()], wire.others)  # every flag down before any sender looks

    def begin_step(self, number: int) -> None:
        """Start step ``number`` (> 0; the same on every rank, failed steps counted): a flag raised in an earlier
        step is not this one's."""
        self.step = number

    def send(self, tag: int, data: np.ndarray) -> None:
        """Copy ``data`` into the slot of message ``tag`` and raise its flag."""
        slot, flag = self.outgoing[tag]
        if data.shape != slot.shape or data.dtype != slot.dtype:
            flag[0] = -self.step  # the receiver raises too, instead of waiting for its deadline
            what, stage, mb = self.outgoing_keys[tag]
            raise MpcommError(f"pipeline: the {'activation' if what == 'F' else 'gradient'} of stage {stage} for "
                              f"micro-batch {mb} is {data.dtype}{list(data.shape)} where the first step agreed "
                              f"{slot.dtype}{list(slot.shape)}; call reset_shapes() on every rank first")
        slot[...] = data
        assert self.window is not None  # outgoing holds slots of the window
        self.window.Sync()  # the slot's bytes before the flag, on any memory model
        flag[0] = self.step

    def arrived(self, tag: int) -> bool:
        """Whether message ``tag`` of this step is in its slot (or its sender failed)."""
        return self.incoming[tag][1][0] in (self.step, -self.step)

    def receive(self, tag: int, peer: int, label: str) -> np.ndarray:
        """Message ``tag`` of this step, in its slot (not a copy: valid until the step's backward of its
        micro-batch), waited for with the wire's deadline."""
        slot, flag = self.incoming[tag]
        self.wire.poll_until(partial(self.arrived, tag), (peer,), label)
        assert self.window is not None  # incoming holds slots of the window
        self.window.Sync()
        if flag[0] < 0:
            raise MpcommError(f"{label}: rank {peer} had a message of another shape or dtype than agreed "
                              f"({slot.dtype}{list(slot.shape)}); see its error")
        return slot

    def release_views(self) -> bool:
        """Drop this object's arrays on the window; whether no other array on it is left (then :meth:`free` may
        unmap it)."""
        self.incoming, self.outgoing = {}, {}
        segments, self._segments = self._segments, []
        # a view's base is its segment: references beyond this list and getrefcount's argument are someone's view
        return all(sys.getrefcount(segment) <= 3 for segment in segments)

    def free(self) -> None:
        """Release the window (collective over the node: call once every rank of the pipeline is known to be
        here, and after :meth:`release_views` said True on each)."""
        if self.window is not None:
            self.window.Unlock_all()
            self.window.Free()
            self.window = None


def _free_shared_memory() -> int | None:
    """Bytes free in /dev/shm, where MPICH maps a shared window's memory (None where there is none)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _views(segment: np.ndarray, where: tuple[int, int, int], shape: tuple, dtype: np.dtype) -> tuple:
    """The slot (an array of ``shape`` and ``dtype``) and the flag of a message at ``where`` in ``segment``."""
    slot_at, flag_at, nbytes = where
    if nbytes != _nbytes(shape, dtype):  # pragma: no cover - the first step's handshake agreed every size
        raise MpcommError(f"pipeline: a message of {dtype}{list(shape)} where its receiver expects {nbytes} bytes")
    return (segment[slot_at:slot_at + nbytes].view(dtype).reshape(shape),
            segment[flag_at:flag_at + 8].view(np.int64))


def _nbytes(shape: tuple, dtype: np.dtype) -> int:
    return int(np.prod(shape)) * dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // _LINE) * _LINE
