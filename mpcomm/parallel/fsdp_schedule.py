"""When FSDP gathers, frees and reduces: the module hooks and the prefetch order (no buffer arithmetic here).

Per unit, by strategy:
  full_shard / hybrid_shard  gather before forward, free after forward, gather again before backward,
                             free after backward; reduce the flat gradient right after the unit's backward.
  shard_grad_op / no_shard   gather before forward, keep through backward, free after backward.
Backward prefetch: the next unit in backward order (the reverse of the order in which units *finished* their
forward, which for nested units is exactly the order their backward starts) gets an ``iall_gather`` issued
either before this unit's backward compute (``"pre"``) or right after it (``"post"``). ``limit_all_gathers``
keeps at most two such gathers in flight. At most one gradient reduction is outstanding at a time, so the
reduce-scatter of one unit overlaps the backward compute of the next while unsharded gradients never pile up.
"""
from __future__ import annotations

from collections import deque

from .fsdp_unit import FlatUnit

MAX_INFLIGHT_ALL_GATHERS = 2


class Schedule:
    def __init__(self, units: list[FlatUnit], reshard_after_forward: bool, backward_prefetch: str | None,
                 forward_prefetch: bool, limit_all_gathers: bool):
        self.units = units
        self.reshard_after_forward = reshard_after_forward
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        self.inflight: deque[FlatUnit] = deque()
        self.reducing: deque[FlatUnit] = deque()
        self.fwd_started: list[FlatUnit] = []      # this forward, in pre-hook order
        self.fwd_finished: list[FlatUnit] = []     # this forward, in post-hook order
        self.prev_fwd_started: list[FlatUnit] = []
        self.bwd_order: list[FlatUnit] = []
        self.bwd_started: set[int] = set()         # ids of units whose backward began in this backward
        self.counters = {"all_gathers": 0, "prefetched": 0, "prefetch_hits": 0, "max_inflight_all_gathers": 0,
                         "reduces": 0}
        self.keep_after_forward = False          # eval forward: free everything after forward anyway

    # ---- helpers -----------------------------------------------------------------------------
    def _gather_now(self, u: FlatUnit) -> None:
        if u.state == "gathering":
            if u in self.inflight:
                self.inflight.remove(u)
                self.counters["prefetch_hits"] += 1
            u.finish_gather()
        elif u.state == "sharded":
            self.counters["all_gathers"] += 1
            u.start_gather(blocking=True)
            u.finish_gather()

    def _prefetch(self, u: FlatUnit | None) -> None:
        if u is None or u.state != "sharded" or id(u) in self.bwd_started:
            return
        if self.limit_all_gathers and len(self.inflight) >= MAX_INFLIGHT_ALL_GATHERS:
            self.inflight.popleft().finish_gather()
        self.counters["all_gathers"] += 1
        self.counters["prefetched"] += 1
        u.start_gather(blocking=False)
        if u.state == "gathering":
            self.inflight.append(u)
        self.counters["max_inflight_all_gathers"] = max(self.counters["max_inflight_all_gathers"],
                                                        len(self.inflight))

    @staticmethod
    def _after(order: list[FlatUnit], u: FlatUnit) -> FlatUnit | None:
        for i, v in enumerate(order):
            if v is u:
                return order[i + 1] if i + 1 < len(order) else None
        return None

    def _drain_reduces(self) -> None:
        while self.reducing:
            self.reducing.popleft().finish_reduce()

    # ---- step boundaries ---------------------------------------------------------------------
    def begin_forward(self) -> None:
        self.fwd_started, self.fwd_finished, self.bwd_started = [], [], set()

    def end_forward(self, training: bool) -> None:
        self.prev_fwd_started = list(self.fwd_started)
        self.bwd_order = list(reversed(self.fwd_finished))
        self.bwd_started = set()
        if not training:
            self.release_all()

    def end_backward(self) -> None:
        self._drain_reduces()
        self.release_all()

    def release_all(self) -> None:
        """Complete in-flight gathers and free every gathered unit (nothing stays gathered between steps)."""
        while self.inflight:
            self.inflight.popleft().finish_gather()
        for u in self.units:
            u.free()

    # ---- hooks -------------------------------------------------------------------------------
    def pre_forward(self, u: FlatUnit) -> None:
        self.fwd_started.append(u)
        self._gather_now(u)
        if self.forward_prefetch:
            self._prefetch(self._after(self.prev_fwd_started, u))

    def post_forward(self, u: FlatUnit) -> None:
        self.fwd_finished.append(u)
        if self.reshard_after_forward:
            u.free()

    def pre_backward(self, u: FlatUnit) -> None:
        self.bwd_started.add(id(u))
        self._gather_now(u)
        u.prepare_grads()
        if self.backward_prefetch == "pre":
            self._prefetch(self._after(self.bwd_order, u))

    def post_backward(self, u: FlatUnit) -> None:
        if self.backward_prefetch == "post":
            self._prefetch(self._after(self.bwd_order, u))
        self._drain_reduces()
        u.start_reduce()
        self.counters["reduces"] += 1
        self.reducing.append(u)
        u.free()
