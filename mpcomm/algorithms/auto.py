"""Adaptive algorithm choice: a measured calibration table when there is one, else an alpha-beta cost model.

The choice depends on (operation, message bytes, dtype) and on the communicator's shape (``Layout``: size and
the ranks of every node). All of these are the same on every rank, and a tuned table is decided on rank 0
and broadcast (``mpcomm.tuning``), so ranks never choose differently.

With a table, the algorithm measured fastest at the nearest measured size (on a log scale) is taken; the
table is only used for the layout it was measured on. Without one, ``CostModel`` predicts the time of each
candidate and the cheapest wins. The model is a textbook alpha-beta-gamma model. When a communicator spans
several hosts its network constants are measured when it is created (``mpcomm.topology``: the latency and
the bytes per second of one node's link, agreed by every rank), because they decide between node-aware and
flat algorithms and differ by 100x between networks; its other constants are rough defaults for a
shared-memory node, so treat its choices (and ``crossovers``) as the model's opinion: ``Communicator.tune()``
replaces them by measured choices.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from .. import topology
from ..buffers import AVG, LOW_PRECISION, MAX, MIN, SUM, wire_dtype
from ..compression import codec
from ..kernels import KEY_DTYPES
from ..mpi_library import Library, copies_input, library
from ..tuning.table import TABLE_FORMAT, check_table
from . import KEEP_LOW_PRECISION
from .native import one_call_takes
from .rhd import EXCHANGE_UPTO

# algorithms whose every step waits for its partner's previous one, reduction included (not direct's one exchange)
STEPWISE = ("ring", "ring_pipelined", "rhd", "tree", "hierarchical")
STEADY = ("ring", "ring_pipelined")  # algorithms whose every rank talks to the same two peers all call long
MEMO_SIZE = 1024  # decisions remembered (Selector.choose): varying sizes must not grow memory
STEADY_MARGIN = 0.05  # across nodes, a ring this close to the cheapest prediction is preferred (Selector.predict)
WIRE_MARGIN = 0.2  # a compressed wire must be predicted this much faster than float32 to be used (Selector.wire_pays)
FRESH_PAGES_FROM = (32 << 20) - 4096  # glibc maps blocks from 32 MiB (its largest mmap threshold) fresh, header in
_FLOAT32 = np.dtype(np.float32)
# CostModel's terms for what a core does (a step's wait for its peer to run, a byte copied, reduced or converted),
# which ranks sharing cores pay r times over (CostModel.for_layout)
_SHARED_CORE_TERMS = ("alpha_py", "alpha_native", "alpha_exchange", "alpha_segment", "alpha_pass", "alpha_kernel",
                      "alpha_widen", "beta", "gamma", "widen_byte", "pass_byte", "kernel16_byte", "fresh_page_byte")


@dataclass(frozen=True)
class Layout:
    """The shape of a communicator: its size and the number of ranks on each node (in node-leader rank order)."""

    size: int
    node_sizes: tuple[int, ...]
    # > 1: more ranks than cores on a host; a property of where the job runs, not of its shape (so not compared,
    # and not part of a tuning table's layout)
    ranks_per_core: float = field(default=1.0, compare=False)

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    @property
    def uniform(self) -> bool:
        return len(set(self.node_sizes)) == 1

    @property
    def ranks_per_node(self) -> int:
        """Ranks per node (the largest node when nodes differ)."""
        return max(self.node_sizes)

    @classmethod
    def of(cls, comm) -> "Layout":
        """The layout of a Communicator (from what its constructor measured; no communication)."""
        return cls(comm.size, tuple(comm.node_sizes), max(1.0, comm.ranks_per_core))

    @classmethod
    def blocks(cls, size: int, ranks_per_node: int) -> "Layout":
        """Consecutive blocks of ``ranks_per_node`` ranks (the last node may be smaller)."""
        full, rest = divmod(size, ranks_per_node)
        return cls(size, (ranks_per_node,) * full + ((rest,) if rest else ()))

    def to_json(self) -> dict:
        return {"size": self.size, "node_sizes": list(self.node_sizes)}


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of each algorithm: Hockney's alpha-beta model plus a gamma reduction term
    (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009 for the ring).

    A message of m bytes costs ``alpha + m * beta`` inside a node and ``alpha + alpha_net + m * beta_net``
    between nodes; reducing m bytes costs ``m * gamma``. When all q ranks of a node send across the network
    in the same round (flat recursive halving does this), they share the node's link, so that round costs
    ``q * m * beta_net``. ``alpha_py`` is one step of an mpcomm algorithm (Python loop + MPI call + numpy),
    ``alpha_native`` one step inside the MPI library. The pipelined ring sends each reduce-scatter step as
    ``SEGMENT_BYTES`` segments, ``alpha_segment`` each (measured: bench/results/observations.md), and overlaps
    the reduction of one with the transfer of the next: per step ``chunk * max(beta, gamma)`` plus one segment's
    smaller term.

    ``native_byte_scale`` multiplies the shared-memory per-byte terms of ``native`` (not its bytes on a network
    link, which go at the link's rate): the MPI library's Allreduce is modelled as rhd run in C, but MPICH's
    shared-memory path moved fewer bytes per second than mpcomm's ring/rhd from 512 KiB up in the sweeps of
    ``bench/sweep.sh`` (bench/results/README.md), so without it the model kept ``native`` past
    the measured crossover (between 128 and 512 KiB at p = 2, 512 KiB and 2 MiB at p = 4 on 2 cores). These
    defaults are MPICH's; another library's profile replaces them (``mpcomm.mpi_library``: Open MPI's blocking
    all-reduce, which ``native`` makes there for large messages, moves bytes faster than mpcomm's algorithms).

    ``direct`` moves and reduces the ring's bytes, on one node in two exchanges priced as p steps
    (:meth:`direct`), across nodes priced as the ring; float16/bfloat16 stay 16-bit in it (:meth:`passes`).

    Defaults are rough guesses for a shared-memory node and a 100 Gb/s-class network, not measurements;
    ``with_network`` puts a measured network in (``Selector.default`` does so when the ranks span hosts).
    Across nodes every algorithm is charged for the bytes each node's link carries (at 2 nodes x 2 ranks:
    ring 1.5 n, rhd 2 n, hierarchical and native n), which is what decides on a slow network.
    """

    alpha_py: float = 25e-6
    alpha_native: float = 3e-6
    # rhd's all-reduce of two ranks up to EXCHANGE_UPTO is one exchange, on host arrays one C call (rhd.express):
    # besides its bytes, priced below native's two steps up to ``exchange_upto`` bytes, where timed call by call it
    # took 0.7-0.9x native's time on Open MPI (to 16 KiB; 1.0-1.2x at 32 KiB) and 0.8-1.07x on MPICH (to 4 KiB;
    # from 8 KiB its integer sums 1.5-2x native's) (openmpi.md, "Stop 59"); above, priced as rhd's steps. None
    # where no such call is made (the torch backend's groups, whose C++ all-reduce is native's: torch/group.py).
    alpha_exchange: float | None = 1.5e-6
    exchange_upto: int = 4 << 10
    # The same for floats (float16/bfloat16 on their float32 work array), which the exchange reduces with mpcomm's
    # own ops where integers take the library's (None: ``exchange_upto``), and for their min/max up to that many
    # bytes of the buffer: in three runs of calls one at a time on either library (p = 2) the exchange took
    # 0.7-0.99x native's time for float sums to 32 KiB on the wire; for min/max 0.77-0.98x to 16 KiB (MPICH's
    # float32/64 0.96-1.07 at 16 KiB), float32/64's 1.01-1.17x at 32 KiB, 16-bit buffers' 0.91-0.98x at 16 KiB
    # (32 KiB on the wire); MPICH's integers 1.2-2x from 8 KiB (dtype_op.md, "Stop 61", "Stop 63").
    exchange_floats_upto: int | None = 32 << 10
    exchange_min_max_upto: int = 16 << 10
    alpha_segment: float = 10e-6
    alpha_net: float = 2e-6
    beta: float = 1 / 5e9
    beta_net: float = 1 / 10e9
    gamma: float = 1 / 8e9
    native_byte_scale: float = 1.5
    # native's float min/max on one node: mpcomm's own MPI ops (mpi_library.Library.min_max_op), else integer keys
    # and a pass each way. Across nodes native keeps MPI's ops, so the keys, on every library.
    native_min_max_op: bool = True
    # Across nodes native polls the library's non-blocking all-reduce: MPICH's is node-aware; Open MPI's (libnbc)
    # runs an in-place one as a binomial reduce, then a binomial broadcast ("binomial"; bench/results/cluster.md).
    native_polled: str = "node_aware"
    # (nodes and ranks at least, bytes more than) where native polls that all-reduce from a copy of the input, which
    # Open MPI's runs as Rabenseifner's, the near halves first (mpi_library.Library.polled_from_copy; ``of_library``)
    native_polled_from_copy: tuple[int, int, int] | None = None
    # On one node with ranks sharing cores native polls that non-blocking all-reduce too, unless the library's
    # profile makes its blocking call there (mpi_library.Library.blocking_on_shared_cores; set by ``of_library``).
    native_polls_shared_cores: bool = True
    overlap: bool = True
    # On one node the pipelined ring would overlap only where the library moved a message while the receiver
    # computes; MPICH's and Open MPI's shared memory move it inside the receiver's MPI calls (at p = 2 on 2 cores the
    # pipelined ring took 1.16-1.20x the ring at 8 MiB and 0.9-1.1x at 32 MiB on both: dtype_op.md, "Stop 32").
    overlap_in_node: bool = False
    # Reducing a received block of more than ``cache_bytes`` in one pass reads it back from memory, not from cache:
    # ``cold_byte`` more per byte of it. The pipelined ring's segments are reduced as they arrive and never pay it
    # (p = 2 on one node, both libraries: from 32 MiB the ring, rhd and direct took 1-4 ms more than the pipelined
    # ring, 0.10 ns per byte of their 16-32 MiB chunks, dtype_op.md, "Stop 34"; at 16 MiB, 8 MiB chunks, the model
    # misses fewer cells with it on both libraries in the sweeps of Stops 34 and 37 and in five runs of calls one at
    # a time: "Stop 53").
    cache_bytes: float = 4 << 20
    cold_byte: float = 0.1e-9
    # With ranks sharing cores on one node, an all-reduce's per-byte terms in the algorithms that go step by step
    # (``STEPWISE``) against direct's: a rank waiting for its partner's step spins on a core the others need, where
    # direct's one exchange lets every rank that runs move all its parts (p = 4 on 2 cores, 2-64 MiB, both
    # libraries: rhd took a median 1.06-1.16x direct's time, the ring 1.02-1.47x; dtype_op.md, "Stop 54").
    stepwise_shared: float = 1.1
    # A step of mpcomm's own algorithms on one node, where the library's profile measured it (None: alpha_py).
    alpha_py_in_node: float | None = None
    # The library copies a message between ranks of a node once, the receiver reading the sender's memory (Open
    # MPI's CMA), so a pair that sends and receives in turns needs one core, not two: with ranks sharing cores a
    # binomial tree's rounds are not slowed while its pairs have a core each (``tree``). MPICH copies through
    # shared memory on both sides.
    single_copy: bool = False
    # The library's all-reduce takes a temporary as large as the message every call, and glibc maps one of
    # FRESH_PAGES_FROM bytes or more fresh each time (its largest mmap threshold): seconds per byte of faulting it
    # in (MPICH and Open MPI at p = 2 on one node, 32-64 MiB; openmpi.md, "Stop 32").
    fresh_page_byte: float = 0.19e-9
    # Local passes over the data besides the wire and the reduction (``passes``), seconds per byte of the user's
    # buffer: float16 and bfloat16 widened to float32 and narrowed back (the extension's cast16, a work array's round
    # trip: 0.12 ns a byte at 64 KiB-4 MiB in blocks of calls, bench/results/dtype_op.md, "Stop 33"; MPICH's widened
    # native all-reduce took 0.2-0.25 a byte more than float32's of the same wire to 32 KiB, "Stop 61"); one
    # read-modify-write pass (avg's division); direct's compiled float32 reduction of 16-bit parts, per byte read.
    # (native's NaN check after a float sum is in native_byte_scale.)
    widen_byte: float = 0.2e-9
    pass_byte: float = 40e-12
    kernel16_byte: float = 65e-12
    # native's per-byte cost for integers (and bool, as uint8) of each item size, against floats': MPICH reduces
    # 1- and 2-byte ones at about half its rate for 4- and 8-byte ones, where numpy's loops do not slow down; and it
    # moved 4- and 8-byte integer sums and maxima at ~0.85 of float32's time at 512 KiB-1 MiB on one node, where the
    # ring takes floats (bench/results/dtype_op.md, "Stop 32": where native and the ring cross).
    native_int_scale: tuple = ((1, 2.0), (2, 1.6), (4, 0.8), (8, 0.8))
    # native's per-byte terms on one node against the scheme it is priced as, per collective (the rest: 1):
    # MPICH's non-blocking reduce-scatter took 1.4-1.6x mpcomm's ring from 2 MiB at p = 2 (2.6-3.9x at 128-512 KiB,
    # where its blocking one does not); the library's profile gives its own (bench/results/dtype_op.md, "Stop 33:
    # reduce-scatter"). Across nodes a reduce-scatter is half an all-reduce (``half_allreduce``).
    native_collective_scale: tuple = (("reduce_scatter", 3.0),)
    alpha_pass: float = 1.5e-6  # one such pass's call (a numpy ufunc or a ctypes kernel), however small
    # A widened all-reduce's fixed cost, its work array's round trip (float16/bfloat16 by native at p = 2, 8 B:
    # 3.2-5.0 us over float32's of the same wire on either library, both its plan's one C call; dtype_op.md,
    # "Stop 61").
    alpha_widen: float = 4e-6
    # One call of the extension module's float passes (``mpcomm.kernels``: avg's finish), however small, its Python
    # wrapper included (bench/results/observations.md, "The extension's passes").
    alpha_kernel: float = 0.3e-6
    # The wire codecs' compiled passes (mpcomm.compression), seconds per byte of the float32 vector: encode,
    # decode, decode-and-add (64 MiB, best of 5, quiet; bench/results/compression.md).
    codec_byte: tuple = (("bf16", (0.17e-9, 0.31e-9, 0.22e-9)), ("fp16", (0.15e-9, 0.25e-9, 0.25e-9)),
                         ("int8", (0.27e-9, 0.30e-9, 0.13e-9)))

    @classmethod
    def of_library(cls, profile: Library) -> "CostModel":
        """The model with an MPI library's own constants (its profile's ``cost_model``; the defaults are MPICH's)."""
        return cls(native_min_max_op=profile.min_max_op, native_polls_shared_cores=not profile.blocking_on_shared_cores,
                   native_polled_from_copy=profile.polled_from_copy, **dict(profile.cost_model))

    def with_network(self, network: "topology.NetworkMeasurement") -> "CostModel":
        """This model with the measured latency and seconds per byte between nodes."""
        return replace(self, alpha_net=network.latency, beta_net=network.seconds_per_byte)

    def for_layout(self, layout: Layout) -> "CostModel":
        """The model as it applies on ``layout``: on one node, the library's own figures for it (``overlap_in_node``,
        ``alpha_py_in_node`` where every rank has a core). With more ranks than cores (``ranks_per_core`` r > 1) each
        rank has 1/r of a core while all work at once, so every step's wait for its peer to be scheduled (25 us x r
        on either library: 35-45 us per step of rhd at p = 4 on 2 cores) and every byte a core moves or reduces takes
        r times as long (``_SHARED_CORE_TERMS``; the network's terms do not), and nothing overlaps: no core is free to
        move one segment while this rank reduces another (at p = 4 on 2 cores Stop 35's sweeps put rhd's 2 log p
        steps ahead of the (pipelined) ring's 2(p-1) from 2 MiB up, where without oversubscription the pipelined ring
        wins; timed call by call in Stop 54, direct's one exchange led both: ``stepwise_shared``, which
        :meth:`allreduce` applies). A block reduced out of cache costs nothing visible beside those waits
        (``cold_byte``: at p = 4 on 2 cores rhd, reducing 16 MiB halves, kept up with the ring's 8 MiB chunks at
        32 MiB; dtype_op.md, "Stop 35"). (With the alphas alone scaled, the bytes were priced at a quarter to a third
        of what they took at p = 4 on 2 cores, and native kept 16-bit all-reduces of 256 KiB that direct moved in
        0.5-0.85x its time; dtype_op.md, "Stop 36".)"""
        r = layout.ranks_per_core
        model = self
        if layout.num_nodes == 1 and not self.overlap_in_node:
            model = replace(model, overlap=False)
        if r <= 1:
            if layout.num_nodes == 1 and self.alpha_py_in_node is not None:
                model = replace(model, alpha_py=self.alpha_py_in_node)
            return model
        shared = {name: value * r for name in _SHARED_CORE_TERMS if (value := getattr(model, name)) is not None}
        return replace(model, overlap=False, cold_byte=0.0, **shared)

    # -------------------------------------------------------------- building blocks
    def _link(self, crosses: bool, alpha: float) -> tuple[float, float]:
        return (alpha + self.alpha_net, self.beta_net) if crosses else (alpha, self.beta)

    def _reduce(self, m: float) -> float:
        """Seconds of reducing a received block of m bytes in one pass (cold past ``cache_bytes``)."""
        return m * (self.gamma + (self.cold_byte if m > self.cache_bytes else 0.0))

    def ring(self, n: float, p: int, crosses: bool, alpha: float, segment: float | None = None) -> float:
        """Ring reduce-scatter + all-gather over p ranks (each step crosses the network if ``crosses``)."""
        a, b = self._link(crosses, alpha)
        chunk = n / p
        gather = (p - 1) * (a + chunk * b)
        if segment is None:
            return gather + (p - 1) * (a + chunk * b + self._reduce(chunk))
        pieces = max(1, math.ceil(chunk / segment))
        if self.overlap:
            overlapped = chunk * max(b, self.gamma) + min(chunk, segment) * min(b, self.gamma)
        else:
            overlapped = chunk * (b + self.gamma)
        step = a + (pieces - 1) * self.alpha_segment + overlapped
        return gather + (p - 1) * step

    def direct(self, n: float, p: int, crosses: bool, alpha: float) -> float:
        """Direct reduce-scatter (this rank's segment's p - 1 parts in one exchange, then reduced) and all-gather
        (its segment to the p - 1 others at once): the ring's bytes and reductions, its latency p steps', not
        2(p - 1) (priced as two steps, the model gave p = 4 on 2 cores direct's float all-reduces of 256 KiB, which
        native took in 0.7-0.9x its time: bench/results/dtype_op.md, "Stop 63"). Across nodes, priced as the ring."""
        if crosses:
            return self.ring(n, p, crosses, alpha)
        chunk = n / p
        return p * alpha + 2 * (p - 1) * chunk * self.beta + (p - 1) * self._reduce(chunk)

    def rhd(self, n: float, layout: Layout, alpha: float, near_first: bool = False) -> float:
        """Recursive halving + doubling over the largest power of two, with the fold for the remainder: the halves
        exchanged with the farthest partner first (mpcomm's), or with the nearest (``near_first``: MPICH's and Open
        MPI's, whose largest halves then stay inside a node)."""
        p, q = layout.size, layout.ranks_per_node
        p2 = 1 << (p.bit_length() - 1)
        total = 0.0
        if p2 != p:  # the fold pairs ranks 2i, 2i+1: some pair straddles two nodes when a node's rank count is odd
            a, b = self._link(layout.num_nodes > 1 and q % 2 == 1, alpha)
            total = 2 * (a + n * b) + self._reduce(n)
        distances, part = [1 << k for k in range(p2.bit_length() - 1)], n / 2  # (1, 2, .., p2 / 2)
        for distance in distances if near_first else reversed(distances):  # halving exchanges `part` bytes at
            crosses = layout.num_nodes > 1 and distance >= q  # this distance; doubling mirrors it
            a, b = self._link(crosses, alpha)
            total += 2 * (a + part * b * (q if crosses else 1)) + self._reduce(part)
            part /= 2
        return total

    def exchange(self, n: float, layout: Layout, alpha: float) -> float:
        """Two ranks all-reducing n bytes by one exchange (rhd's up to ``EXCHANGE_UPTO``): a message each way, the
        whole vector reduced."""
        a, b = self._link(layout.num_nodes > 1, alpha)
        return a + n * b + self._reduce(n)

    def tree(self, n: float, layout: Layout, alpha: float | None = None) -> float:
        """Binomial reduce to rank 0 then binomial broadcast: every round moves the whole vector. Where messages
        are copied once, by the receiver (``single_copy``), a round's p / (2 mask) pairs need a core each, not two:
        with r ranks on each core (the terms r times their own: :meth:`for_layout`) a round within a node takes
        max(1, r / (2 mask)) / r of that."""
        total, mask, r = 0.0, 1, layout.ranks_per_core
        while mask < layout.size:
            crosses = layout.num_nodes > 1 and mask >= layout.ranks_per_node
            a, b = self._link(crosses, self.alpha_py if alpha is None else alpha)
            cores = max(1.0, r / (2 * mask)) / r if self.single_copy and r > 1 and not crosses else 1.0
            total += cores * (2 * (a + n * b) + self._reduce(n))
            mask <<= 1
        return total

    def hierarchical(self, n: float, layout: Layout) -> float:
        q, nodes = layout.ranks_per_node, layout.num_nodes
        if layout.uniform:  # ring inside the node; q peer groups each all-reduce n/q bytes, sharing the link
            inner = self.ring(n, q, False, self.alpha_py) if q > 1 else 0.0
            return inner + self._across(n / q, nodes, q)
        return self.tree(n, Layout(q, (q,))) + self._across(n, nodes, 1)  # leader variant

    def _across(self, n: float, nodes: int, sharing: int, alpha: float | None = None) -> float:
        """rhd all-reduce of n bytes among one rank per node, ``sharing`` such groups per link at once."""
        if nodes == 1:
            return 0.0
        a, b = self._link(True, self.alpha_py if alpha is None else alpha)
        rounds = math.ceil(math.log2(nodes))
        return 2 * rounds * a + 2 * (nodes - 1) / nodes * n * b * sharing + (nodes - 1) / nodes * n * self.gamma

    # -------------------------------------------------------------- per collective
    def allreduce(self, algorithm: str, nbytes: float, layout: Layout) -> float:
        if layout.ranks_per_core > 1 and layout.num_nodes == 1 and algorithm in STEPWISE:
            return self._scaled(lambda m: self._allreduce(algorithm, m, layout), nbytes, self.stepwise_shared)
        return self._allreduce(algorithm, nbytes, layout)

    def _allreduce(self, algorithm: str, nbytes: float, layout: Layout) -> float:
        p, n = layout.size, float(nbytes)
        if p == 1:
            return 0.0
        crosses = layout.num_nodes > 1
        if algorithm == "ring":
            return self.ring(n, p, crosses, self.alpha_py)
        if algorithm == "ring_pipelined":
            from .pipelined import SEGMENT_BYTES

            return self.ring(n, p, crosses, self.alpha_py, segment=SEGMENT_BYTES)
        if algorithm == "rhd":  # (two ranks' exchange is priced in call(), whose dtype and op say which it is)
            return self.rhd(n, layout, self.alpha_py)
        if algorithm == "tree":
            return self.tree(n, layout)
        if algorithm == "hierarchical":
            return self.hierarchical(n, layout)
        if algorithm == "native":
            return self.native_allreduce(n, layout)
        if algorithm == "direct":
            return self.direct(n, p, crosses, self.alpha_py)
        return math.inf

    def passes(self, operation: str, algorithm: str, nbytes: int, layout: Layout, dtype: np.dtype,
               op: str | None) -> float:
        """Seconds of the local passes over a reduction's data that (algorithm, op, dtype) adds to the collective:
        float16/bfloat16 widened to float32 and back (all but direct; direct's compiled reduction instead),
        native's float min/max mapped to integer keys and back where it keeps MPI's ops (across nodes, or a library
        without ``native_min_max_op``; on one node it assumes ``native_calls`` built, as it is where ``mpi.h`` is),
        avg's division (of the part each rank finishes).
        ``nbytes`` is the user's buffer; the wire bytes are :meth:`wire_bytes`."""
        if op is None or layout.size == 1 or nbytes == 0:
            return 0.0
        n, p = float(nbytes), layout.size
        wire = self.wire_bytes(algorithm, nbytes, dtype, op)
        total = 0.0
        if dtype in LOW_PRECISION:
            if algorithm in KEEP_LOW_PRECISION:
                total += self.alpha_pass + n * self.kernel16_byte
            else:
                total += self.alpha_widen + n * self.widen_byte
        keys = layout.num_nodes > 1 or not self.native_min_max_op
        if algorithm == "native" and op in (MIN, MAX) and keys and (dtype.kind == "f" or dtype in LOW_PRECISION):
            total += 2 * (self.alpha_kernel + wire * self.pass_byte)  # to keys and back
        if op == AVG:
            total += self.avg_finish(algorithm, wire, p, dtype)
        return total

    def avg_finish(self, algorithm: str, wire: float, p: int, dtype: np.dtype) -> float:
        """Seconds avg's division adds to a sum of ``wire`` bytes. Where the extension does it for a float32/float64
        wire it costs its call at most: native's is one extension pass, with the NaN check a large sum makes anyway
        (a small sum checks inside its one C call), writing the vector back; the ring's, pipelined ring's, rhd's
        and direct's rides on their last addition (one pass either way), and direct's float16/bfloat16 divide in
        their reduction pass. Otherwise it is a numpy pass of its own over what the rank finishes (tree: the whole
        vector; the others: 1/p of it)."""
        widened = dtype in LOW_PRECISION and algorithm not in KEEP_LOW_PRECISION
        by_extension = widened or dtype in KEY_DTYPES
        if algorithm == "native" and by_extension:
            return self.alpha_kernel + wire * self.pass_byte
        if algorithm in ("ring", "ring_pipelined", "rhd", "direct") and (by_extension or dtype in LOW_PRECISION):
            return 0.0
        return self.alpha_pass + wire * self.pass_byte / (1 if algorithm in ("native", "tree") else p)

    @staticmethod
    def wire_bytes(algorithm: str, nbytes: int, dtype: np.dtype | None, op: str | None) -> int:
        """The bytes ``algorithm`` reduces: float16/bfloat16 widened to float32 by all but direct."""
        if op is not None and dtype in LOW_PRECISION and algorithm not in KEEP_LOW_PRECISION:
            return 2 * nbytes
        return nbytes

    def call(self, operation: str, algorithm: str, nbytes: int, layout: Layout, dtype: np.dtype | None = None,
             op: str | None = None) -> float:
        """Predicted seconds of a whole call: the collective on the bytes it moves plus :meth:`passes`."""
        if dtype is None:
            return self.collective(operation, algorithm, nbytes, layout)
        exchange = self._exchange(nbytes, layout, dtype, op) if operation == "allreduce" and algorithm == "rhd" \
            else None
        if exchange is not None:
            return exchange
        wire = self.wire_bytes(algorithm, nbytes, dtype, op)
        seconds = self.collective(operation, algorithm, wire, layout)
        scale = dict(self.native_int_scale).get(dtype.itemsize, 1.0) if dtype.kind in "iub" else 1.0
        if scale < 1.0 and layout.num_nodes > 1:
            scale = 1.0  # (a saving of the library's shared-memory path: a network's bytes go at its rate)
        if algorithm == "native" and op is not None and scale != 1.0:
            seconds += (scale - 1.0) * (seconds - self.collective(operation, algorithm, 0, layout))
        return seconds + self.passes(operation, algorithm, nbytes, layout, dtype, op)

    def _exchange(self, nbytes: int, layout: Layout, dtype: np.dtype, op: str | None) -> float | None:
        """Seconds of rhd's all-reduce of two ranks of up to ``EXCHANGE_UPTO`` bytes on the wire, one exchange: in
        one C call where native's one C call would take (the wire's dtype, ``op``) (float min/max: where it reduces
        them with mpcomm's own ops, on one node), up to ``exchange_upto`` (floats: ``exchange_floats_upto``, their
        min/max ``exchange_min_max_upto``; above it None: priced as rhd's steps, as it measured); else Python's one
        step. Either with its passes (a 16-bit buffer's widening). None where rhd is not that exchange."""
        wire = self.wire_bytes("rhd", nbytes, dtype, op)
        if layout.size != 2 or not 0 < wire <= EXCHANGE_UPTO or op is None:
            return None
        passes, wired = self.passes("allreduce", "rhd", nbytes, layout, dtype, op), wire_dtype(dtype)
        if one_call_takes(wired, op, layout.num_nodes == 1 and self.native_min_max_op):
            floats, alpha = self.exchange_floats_upto, self.alpha_exchange
            if floats is None or wired.kind != "f":
                within = wire <= self.exchange_upto
            elif op in (MIN, MAX):
                within = nbytes <= self.exchange_min_max_upto  # (the buffer's bytes, not its float32 wire's)
            else:
                within = wire <= floats
            return self.exchange(wire, layout, alpha) + passes if alpha is not None and within else None
        return self.exchange(wire, layout, self.alpha_py) + passes

    def compressed_allreduce(self, wire: str, nbytes: float, layout: Layout) -> float:
        """Predicted seconds of ``allreduce(wire=wire)`` of ``nbytes`` float32 bytes (``algorithms/compressed.py``):
        with nodes of q ranks each, a float32 ring reduce-scatter and all-gather in the node, and between the g
        nodes q groups at once (sharing each node's link) exchanging the wire form of n/q bytes — one all-to-all
        and a ring all-gather, 2(g-1)/g of it per rank — plus the codec's passes over n/q bytes; nodes of
        different sizes: every rank a group of one."""
        p, n = layout.size, float(nbytes)
        q, g = (layout.ranks_per_node, layout.num_nodes) if layout.uniform else (1, p)
        part = n / q
        inner = self.ring(n, q, False, self.alpha_py) if q > 1 else 0.0
        crosses = layout.num_nodes > 1
        a, b = self._link(crosses, self.alpha_py)
        ratio = codec(wire).wire_nbytes(1 << 20) / float(4 << 20)
        sharing = layout.ranks_per_node if crosses else 1
        exchange = g * a + 2 * (g - 1) / g * part * ratio * b * sharing if g > 1 else 0.0
        encode, decode, add = dict(self.codec_byte)[wire]
        passes = 4 * g * self.alpha_pass + part * ((encode + decode) * (1 + 1 / g) + add * (g - 1) / g)
        return inner + exchange + passes

    def half_allreduce(self, algorithm: str, n: float, layout: Layout) -> float:
        """A reduce-scatter or all-gather across nodes: one half of the all-reduce of the same scheme (ring's and
        rhd's all-reduces are exactly reduce-scatter + all-gather), so each node's link carries half its bytes
        (2 x 2: ring 0.75 n, rhd n). ``native`` is modelled as MPICH's recursive halving/doubling in C, bytes
        scaled by ``native_byte_scale`` (FSDP full_shard on 2 x 2 measured ~n per native call on each NIC)."""
        if algorithm in ("ring", "ring_pipelined"):
            return self.allreduce(algorithm, n, layout) / 2
        if algorithm == "rhd":
            return self.rhd(n, layout, self.alpha_py) / 2
        if algorithm == "direct":
            return self.allreduce("ring", n, layout) / 2
        if algorithm == "native":
            return self._native_scaled(lambda m: self.rhd(m, layout, self.alpha_native), n) / 2
        return math.inf

    def native_allreduce(self, n: float, layout: Layout) -> float:
        """The MPI library's all-reduce, run in C, the per-byte terms of its shared-memory part scaled by
        ``native_byte_scale``. On one node MPICH's large-message algorithm is Rabenseifner's rhd; across nodes it
        is node-aware, like MPICH's SMP path: reduce to the node's first rank, all-reduce among those, broadcast
        in the node (the node's link carries what one rank sends, as for ``hierarchical``). Bytes on the network
        go at the link's rate whoever sends them: on 2 x 2 simulated nodes at 1 Gbit/s native took hierarchical's
        time, the same bytes on each NIC, where the scale had priced it well above (bench/results/cluster.md).
        Where native polls a library's that is a binomial tree (``native_polled``: across nodes, and on one node
        where ranks share cores, ``native_polls_shared_cores``), it is mpcomm's tree run in C; where native polls it
        from a copy of the input (``native_polled_from_copy``), the copy and rhd run in C, the near halves first.
        From ``FRESH_PAGES_FROM`` bytes its temporary comes in fresh pages every call."""
        fresh = n * self.fresh_page_byte if n >= FRESH_PAGES_FROM else 0.0
        polled = layout.num_nodes > 1 or (self.native_polls_shared_cores and layout.ranks_per_core > 1)
        if polled and self.native_polled == "binomial":
            if copies_input(self.native_polled_from_copy, layout.num_nodes, layout.size, n):
                return fresh + n * self.beta + self.rhd(n, layout, self.alpha_native, near_first=True)
            return fresh + self.tree(n, layout, self.alpha_native)
        if layout.num_nodes == 1:
            return fresh + self._native_scaled(lambda m: self.rhd(m, layout, self.alpha_native), n)
        node = Layout(layout.ranks_per_node, (layout.ranks_per_node,))
        return (fresh + self._native_scaled(lambda m: self.tree(m, node, self.alpha_native), n)
                + self._across(n, layout.num_nodes, 1, self.alpha_native))

    def _native_scaled(self, cost, n: float) -> float:
        """``cost(n)`` (seconds of a scheme run by the MPI library) with its per-byte part scaled by
        ``native_byte_scale``."""
        return self._scaled(cost, n, self.native_byte_scale)

    @staticmethod
    def _scaled(cost, n: float, scale: float) -> float:
        """``cost(n)`` with its per-byte part, ``cost(n) - cost(0)``, times ``scale``."""
        latency = cost(0.0)
        return latency + scale * (cost(n) - latency)

    def collective(self, operation: str, algorithm: str, nbytes: int, layout: Layout) -> float:
        if operation == "allreduce":
            return self.allreduce(algorithm, nbytes, layout)
        p = layout.size
        if p == 1:
            return 0.0
        if operation in ("reduce_scatter", "all_gather") and layout.num_nodes > 1:
            return self.half_allreduce(algorithm, nbytes, layout)
        alpha = self.alpha_native if algorithm == "native" else self.alpha_py
        a, b = self._link(layout.num_nodes > 1, alpha)
        lg = math.ceil(math.log2(p))
        scale = self._native_collective_scale(operation, layout) if algorithm == "native" else 1.0
        if operation in ("reduce", "all_to_all", "all_to_all_v"):
            return self._rooted_or_personalized(operation, algorithm, float(nbytes), p, lg, a, b, scale)
        # (direct's reduce-scatter is one exchange: every part posted at once, then one pass over them)
        steps = {"ring": p - 1, "ring_pipelined": p - 1, "direct": 1 if operation == "reduce_scatter" else p - 1,
                 "rhd": lg, "tree": lg, "native": lg}
        if algorithm not in steps:
            return math.inf
        moved = nbytes * (lg if operation == "broadcast" and algorithm == "tree" else (p - 1) / p)
        reduce = (p - 1) / p * nbytes * self.gamma if operation == "reduce_scatter" else 0.0
        return steps[algorithm] * a + scale * (moved * b + reduce)

    def _native_collective_scale(self, operation: str, layout: Layout) -> float:
        """``native_collective_scale`` of ``operation`` where it applies (one node), else 1."""
        return dict(self.native_collective_scale).get(operation, 1.0) if layout.num_nodes == 1 else 1.0


    def _rooted_or_personalized(self, operation: str, algorithm: str, n: float, p: int, lg: int, a: float,
                                b: float, native_scale: float = 1.0) -> float:
        """reduce (n: the vector) and all-to-all (n: one rank's send buffer, p blocks of n/p).

        reduce: the binomial tree moves the whole vector in each of log p rounds; Rabenseifner's moves
        2(p-1)/p of it in 2 log p; MPICH's native picks between the two by size (as the min here).
        all-to-all: pairwise sends each block once in p-1 rounds; Bruck sends half the buffer in each of
        log p rounds (and, per-peer counts, exchanges the counts first); MPICH's native uses Bruck for small
        blocks and pairwise exchanges for large ones (the min here), byte terms scaled as for its all-reduce and by
        ``native_scale``.
        """
        scale = self.native_byte_scale * native_scale if algorithm == "native" else 1.0
        if operation == "reduce":
            tree = lg * (a + scale * n * (b + self.gamma))
            halving = 2 * lg * a + scale * (p - 1) / p * n * (2 * b + self.gamma)
            return {"tree": tree, "rhd": halving, "native": min(tree, halving)}.get(algorithm, math.inf)
        pairwise = (p - 1) * a + scale * (p - 1) / p * n * b
        bruck = lg * a + scale * lg * n / 2 * (b + self.beta)  # + packing each round's half buffer
        if operation == "all_to_all_v":
            bruck += lg * a  # the counts' all-gather
        return {"pairwise": pairwise, "bruck": bruck, "native": min(pairwise, bruck)}.get(algorithm, math.inf)


@dataclass
class Selector:
    """Chooses an algorithm per (operation, bytes, dtype) for one communicator layout."""

    layout: Layout
    candidates: dict[str, tuple[str, ...]]
    model: CostModel = field(default_factory=CostModel)
    table: dict | None = None  # a tuning table (see mpcomm.tuning) measured on this layout
    network: topology.NetworkMeasurement | None = None  # measured when the ranks span hosts (else None)
    _decided: dict = field(default_factory=dict, init=False, repr=False)  # (operation, bytes, dtype) -> name

    @property
    def size(self) -> int:
        return self.layout.size

    @classmethod
    def default(cls, comm, probe: bool | None = None) -> "Selector":
        """The model-based selector for a Communicator (collective: computes the node layout and, when the
        ranks span several hosts, measures the network between them; ``probe=False`` (the Communicator's agreed
        setting from env ``MPCOMM_NETWORK_PROBE=0``; None: read it here) skips that and keeps the model's
        default network). The model's constants for ``native`` are the MPI library's (``mpcomm.mpi_library``:
        the same library on every rank, so the same choices), and where native makes the library's blocking call
        under the watchdog (``native.watch``: the same on every rank) two ranks' small all-reduces are native's."""
        from . import REGISTRY

        layout, network, model = Layout.of(comm), None, CostModel.of_library(library())
        if comm.transport.watch is not None:  # native's blocking call under the watchdog is faster than rhd's
            model = replace(model, alpha_exchange=None)  # exchange at any size (openmpi.md, "Stop 62")
        if probe is None:
            probe = os.environ.get("MPCOMM_NETWORK_PROBE", "1").strip().lower() not in ("0", "false", "no", "off")
        if layout.num_nodes > 1 and probe:
            network = topology.measure(comm.transport)  # None when the "nodes" are ranks_per_node blocks of one host
            if network is not None:
                model = model.with_network(network)
        return cls(layout=layout, candidates={op: tuple(algs) for op, algs in REGISTRY.items()}, model=model,
                   network=network)

    @property
    def decisions_kept(self) -> int:
        """How many decisions :meth:`choose` remembers now (at most ``MEMO_SIZE``)."""
        return len(self._decided)

    def choose(self, operation: str, nbytes: int, dtype, op: str | None = None) -> str:
        """The algorithm for this call (``op``: the reduction's name, None for data movement); decisions are
        remembered, so a training loop pays for each once."""
        key = (operation, nbytes, dtype, op)
        name = self._decided.get(key)
        if name is None:
            name = (self._measured(operation, nbytes, np.dtype(dtype))
                    or self.predict(operation, nbytes, dtype=np.dtype(dtype), op=op))
            if len(self._decided) >= MEMO_SIZE:  # a sweep over many sizes: the oldest decision goes
                del self._decided[next(iter(self._decided))]
            self._decided[key] = name
        return name

    def predict(self, operation: str, nbytes: int, candidates=None, dtype: np.dtype | None = None,
                op: str | None = None) -> str:
        """The cost model's choice. Across nodes a ring predicted within ``STEADY_MARGIN`` of the cheapest is
        taken instead: each rank keeps the same two TCP connections busy for the whole call, where schemes that
        change partner every round (rhd, MPICH's native, a tree) start rounds on connections that idled, whose
        window TCP shrinks after an idle spell. Their fastest calls match the ring's, their typical ones do not
        (4 simulated nodes, bench/results/cluster.md), and the model cannot tell such near-ties apart anyway."""
        names = candidates or self.candidates[operation]
        model = self.model.for_layout(self.layout)
        costs = {a: model.call(operation, a, nbytes, self.layout, dtype, op) for a in names}
        best = min(costs, key=costs.__getitem__)
        if self.layout.num_nodes > 1:
            steady = [a for a in STEADY if costs.get(a, math.inf) <= costs[best] * (1 + STEADY_MARGIN)]
            if steady:
                return min(steady, key=lambda a: costs.get(a, math.inf))
        return best

    # -------------------------------------------------------------- compression="auto"
    def price_wire(self, wire: str, nbytes: int) -> tuple[float, float]:
        """Predicted seconds of a float32 sum all-reduce of ``nbytes`` here: (with ``wire``, with the cheapest
        float32 algorithm)."""
        model = self.model.for_layout(self.layout)
        plain = min(model.call("allreduce", a, nbytes, self.layout, _FLOAT32, SUM) for a in self.candidates["allreduce"])
        return model.compressed_allreduce(wire, nbytes, self.layout), plain

    def wire_pays(self, wire: str, nbytes: int) -> bool:
        """Whether ``allreduce(buf, wire=wire)`` of ``nbytes`` float32 bytes pays on this communicator: predicted
        ``WIRE_MARGIN`` faster than the best float32 all-reduce, from the network measured between its nodes and
        the codecs' rates. One host: never (no byte crosses a network, and the passes cost more than the
        shared-memory bytes they would save). The same answer on every rank (facts every rank shares)."""
        if self.layout.num_nodes == 1 or nbytes <= 0:
            return False
        key = ("wire", wire, nbytes)
        pays = self._decided.get(key)
        if pays is None:
            with_wire, without = self.price_wire(wire, nbytes)
            pays = with_wire < (1 - WIRE_MARGIN) * without
            if len(self._decided) >= MEMO_SIZE:
                del self._decided[next(iter(self._decided))]
            self._decided[key] = pays
        return bool(pays)

    def wire_crossover(self, wire: str, sizes=None) -> int | None:
        """The smallest of ``sizes`` (bytes; default 8 B .. 1 GiB by 2x) from which ``wire_pays`` holds at every
        larger one, or None where it never does."""
        sizes = sorted(_PREDICTION_SIZES if sizes is None else sizes)
        crossover = None
        for nbytes in reversed(sizes):
            if not self.wire_pays(wire, nbytes):
                break
            crossover = nbytes
        return crossover

    # -------------------------------------------------------------- calibration table
    def load(self, table: dict, source: str = "tuning table") -> bool:
        """Use ``table`` for later choices if it was measured on this layout; else warn and keep the old one.
        A table in this format with a broken entry raises ValueError naming ``source`` and the entry."""
        if isinstance(table, dict) and table.get("format") == TABLE_FORMAT:
            check_table(table, source)
        problem = self._incompatible(table)
        if problem:
            warnings.warn(f"mpcomm: ignoring {source}: {problem}", RuntimeWarning, stacklevel=3)
            return False
        self.table = table
        self._decided.clear()
        return True

    def _incompatible(self, table: dict) -> str | None:
        if not isinstance(table, dict) or table.get("format") != TABLE_FORMAT:
            return f"not a tuning table (format {TABLE_FORMAT!r} expected)"
        if table.get("layout") != self.layout.to_json():
            return f"it was measured on layout {table.get('layout')}, this communicator is {self.layout.to_json()}"
        for operation, by_dtype in table.get("operations", {}).items():
            for entry in by_dtype.values():
                unknown = set(entry["best"]) - set(self.candidates.get(operation, ()))
                if unknown:
                    return f"{operation} names algorithms this mpcomm does not have: {sorted(unknown)}"
        return None

    def _measured(self, operation: str, nbytes: int, dtype: np.dtype) -> str | None:
        if self.table is None:
            return None
        by_dtype = self.table["operations"].get(operation)
        if not by_dtype:
            return None
        key = str(dtype) if str(dtype) in by_dtype else min(
            by_dtype, key=lambda name: abs(np.dtype(name).itemsize - dtype.itemsize)
        )
        entry = by_dtype[key]
        where = np.log2(max(nbytes, 1))
        nearest = min(range(len(entry["sizes"])), key=lambda i: abs(np.log2(entry["sizes"][i]) - where))
        return entry["best"][nearest]


# ------------------------------------------------------------------ the model's predictions, for the README
_PREDICTION_SIZES = tuple(1 << k for k in range(3, 31))  # 8 B .. 1 GiB


def crossovers(
    ranks=(64, 128, 256, 512, 1024, 2048, 4096),
    ranks_per_node: int = 8,
    algorithms=("ring", "ring_pipelined", "rhd", "tree", "hierarchical"),
    model: CostModel | None = None,
    sizes=_PREDICTION_SIZES,
) -> dict[int, list[tuple[int, str]]]:
    """For each communicator size, the all-reduce algorithm the model prefers and the size it starts at:
    ``{p: [(from_bytes, algorithm), ...]}``. ``native`` is left out by default (the model runs it at C speed)."""
    model = model or CostModel()
    out = {}
    for p in ranks:
        selector = Selector(Layout.blocks(p, ranks_per_node), {"allreduce": tuple(algorithms)}, model)
        regions: list[tuple[int, str]] = []
        for nbytes in sizes:
            best = selector.predict("allreduce", nbytes)
            if not regions or regions[-1][1] != best:
                regions.append((nbytes, best))
        out[p] = regions
    return out


def print_crossovers(**kwargs) -> None:
    """Print ``crossovers`` as a table (one line per communicator size)."""
    rpn = kwargs.get("ranks_per_node", 8)
    print(f"cost-model all-reduce choice by message size ({rpn} ranks per node; model defaults, not measured)")
    for p, regions in crossovers(**kwargs).items():
        print(f"p={p:5d}: " + "  ".join(f"{_human(b)}+ {a}" for b, a in regions))


def _human(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g}{unit}"
    return f"{nbytes}B"

