"""Where the ranks sit (:func:`node_topology`: nodes, their sizes, shared cores) and how fast the network between a
communicator's nodes is (:func:`measure`), both found out once when a Communicator is made.

The network:

The all-reduce algorithms differ mainly in how many bytes each node's NIC carries (at 2 nodes x 2 ranks: ring
1.5 n, rhd 2 n, hierarchical n), and in how many messages cross it; whether that matters depends on the
network's latency and bandwidth, which range from ~1 Gb/s Ethernet to 400 Gb/s fabrics. So ``auto`` measures
them instead of assuming: the first rank of each node (its leader) exchanges messages with one other leader
(hosts 2i and 2i+1, every pair at once), both directions at the same time as the algorithms do:

- latency: the fastest of a few 8-byte round trips, halved;
- bandwidth: back-to-back exchanges of a message, starting at 256 KiB and growing 4x until one takes
  ``TARGET_SECONDS`` (a few ms) or reaches ``MAX_PROBE_BYTES``; the first of each size fills the pipe and
  empties any token bucket a shaper or switch allows bursts from, the fastest of the next ``TIMED`` gives the
  seconds per byte (the fastest: on a shared machine a descheduled rank only ever makes an exchange slower).

The slowest pair decides (a collective is as slow as its slowest link); the numbers are combined with one
MAX all-reduce over the whole communicator, so every rank holds identical values and builds the same model.
Hosts are told apart by processor name (one all-gather). Every wait is bounded by the communicator's deadline
(``Transport.wait``) and no communicator is created: a node that never answers is a ``CommTimeoutError``, not a
hang. The probe takes milliseconds at 1 Gb/s (bench/results/cluster.md); on a single host nothing is measured.
"""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .transport import Transport, split_node

TARGET_SECONDS = 2e-3  # a timed exchange this long is well above the latency, even on a 400 Gb/s link
FIRST_PROBE_BYTES = 256 << 10
MAX_PROBE_BYTES = 16 << 20
ROUND_TRIPS = 5
TIMED = 3
_TAG = 31_000  # the probe finishes before the communicator's first collective; a distinct tag anyway


@dataclass(frozen=True)
class NetworkMeasurement:
    """The network between nodes as measured by :func:`measure` (the slowest measured pair of nodes)."""

    latency: float  # seconds, one way, for an 8-byte message between two nodes (through mpcomm's Transport)
    seconds_per_byte: float  # one direction of one node's link while the other direction is busy too
    probe_bytes: int  # the message size the bandwidth comes from
    seconds: float  # how long the probe took (slowest rank)

    @property
    def bits_per_second(self) -> float:
        return 8.0 / self.seconds_per_byte

    def __str__(self) -> str:
        return (f"network between nodes: {self.bits_per_second / 1e9:.3g} Gbit/s per direction (from "
                f"{self.probe_bytes >> 10} KiB exchanges), latency {self.latency * 1e6:.0f} us; "
                f"probe took {self.seconds * 1e3:.1f} ms")


def measure(t: Transport, host: int | None = None) -> NetworkMeasurement | None:
    """Measure the links between the hosts of ``t``'s communicator; None when all its ranks share one host.

    Collective, and only deadline-bounded Transport calls (no communicator is created). ``host`` names this
    rank's host (default: a hash of ``MPI.Get_processor_name()``); the tests pass rank-made names to probe on
    one machine.
    """
    start = time.perf_counter()
    if host is None:
        host = host_key()
    keys = np.empty(t.size, dtype=np.int64)
    with t.running("network probe"):
        t.wait([t.mpi.Iallgather(np.array([host], dtype=np.int64), keys)], peers=t.others)
        leaders = [r for r in range(t.size) if keys[r] not in keys[:r]]  # each host's lowest rank, in rank order
        if len(leaders) < 2:
            return None
        mine = np.full(4, -1.0)  # latency, seconds per byte, probe bytes, elapsed; -1: this rank measured nothing
        if t.rank in leaders:
            index = leaders.index(t.rank)
            if index ^ 1 < len(leaders):  # hosts 2i and 2i+1 pair up; an odd last one sits out
                partner = leaders[index ^ 1]
                latency = _latency(t, partner)
                seconds_per_byte, nbytes = _bandwidth(t, partner, latency)
                mine[:3] = latency, seconds_per_byte, nbytes
        mine[3] = time.perf_counter() - start
        everyone = np.empty_like(mine)
        t.wait([t.mpi.Iallreduce(mine, everyone, MPI.MAX)], peers=t.others)
    return NetworkMeasurement(float(everyone[0]), float(everyone[1]), int(everyone[2]), float(everyone[3]))


def host_key() -> int:
    """This process's host as a number: a hash of its processor name (distinct per node, also in ci/cluster.sh)."""
    return int.from_bytes(hashlib.sha256(MPI.Get_processor_name().encode()).digest()[:7], "little")


def _latency(t: Transport, partner: int) -> float:
    """Half the fastest of ``ROUND_TRIPS`` 8-byte round trips (the lower rank of the pair sends first)."""
    ping, pong = np.zeros(1, np.float64), np.zeros(1, np.float64)
    t.sendrecv(ping, partner, pong, partner, _TAG)  # both ready (and any connection set up)
    best = float("inf")
    for _ in range(ROUND_TRIPS):
        begin = time.perf_counter()
        if t.rank < partner:
            t.send(ping, partner, _TAG)
            t.recv(pong, partner, _TAG)
        else:
            t.recv(pong, partner, _TAG)
            t.send(ping, partner, _TAG)
        best = min(best, time.perf_counter() - begin)
    return best / 2


def _bandwidth(t: Transport, partner: int, latency: float) -> tuple[float, int]:
    """Seconds per byte of a simultaneous exchange with ``partner``, and the message size that measured it."""
    nbytes = FIRST_PROBE_BYTES
    while True:
        send, recv = np.zeros(nbytes, np.uint8), np.empty(nbytes, np.uint8)  # not kept: up to 16 MiB each
        t.sendrecv(send, partner, recv, partner, _TAG)  # fills the pipe, empties a burst allowance
        times, ready, go = np.empty(TIMED), np.zeros(1), np.zeros(1)
        for i in range(TIMED):
            t.sendrecv(ready, partner, go, partner, _TAG)  # start together: a head start would hide transfer time
            begin = time.perf_counter()
            t.sendrecv(send, partner, recv, partner, _TAG)
            times[i] = time.perf_counter() - begin
        theirs = np.empty(TIMED)
        t.sendrecv(times, partner, theirs, partner, _TAG)  # both sides take the same decision below
        elapsed = float(np.maximum(times, theirs).min())  # an exchange lasts until its slower side is done
        if elapsed >= TARGET_SECONDS or nbytes >= MAX_PROBE_BYTES:
            return max(elapsed - latency, elapsed / 2) / nbytes, nbytes
        nbytes *= 4


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: its place in its node, every node's size (in node-leader rank order), and the largest
    ratio over the machines of ranks to the CPUs they may run on (above 1 the ranks share cores)."""

    node_rank: int
    node_size: int
    node_sizes: tuple[int, ...]
    ranks_per_core: float


def node_topology(t: Transport, ranks_per_node: int | None) -> Topology:
    """The topology of ``t``'s communicator (collective). The split blocks (MPI has no non-blocking split), so
    call it once every rank is known to be here; the exchange after it waits with ``t``'s deadline."""
    node = split_node(t.mpi, ranks_per_node)
    try:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        mine = (node.Get_rank(), node.Get_size(), kernel_key(), cpus)
    finally:
        node.Free()
    everyone = t.allgather_object(mine)
    ratio = ranks_per_core([(kernel, cpus) for _, _, kernel, cpus in everyone])
    return Topology(mine[0], mine[1], tuple(size for rank, size, _, _ in everyone if rank == 0), ratio)


def ranks_per_core(ranks: list[tuple[str, list[int]]]) -> float:
    """The largest ratio over the machines of their ranks to the CPUs those may run on, from every rank's (machine,
    allowed CPUs)."""
    machines: dict[str, list[set]] = {}
    for machine, allowed in ranks:
        machines.setdefault(machine, []).append(set(allowed))
    return float(max(len(sets) / max(1, len(set().union(*sets))) for sets in machines.values()))


def kernel_key() -> str:
    """The machine this process runs on, as the CPUs go: its kernel's boot id, which network namespaces and
    containers on one machine share (ci/cluster.sh's nodes: four ranks on two cores are two to a core however many
    nodes they make), else its processor name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return MPI.Get_processor_name()
