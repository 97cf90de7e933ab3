"""Where a rank sits among the nodes: ``node_rank``, ``node_size``, ``num_nodes`` and the node and cross-node
communicators that hierarchical runs on — detected (ranks sharing a host), or set by ``ranks_per_node`` /
env ``MPCOMM_RANKS_PER_NODE`` (consecutive blocks of ranks), checked against the block arithmetic and against
the host names MPI reports, not against mpcomm's own split.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_node_layout.py`` (any N >= 1).
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import WORLD, in_step, run_gathered
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms.auto import Layout

pytestmark = pytest.mark.mpi

P, RANK = WORLD.Get_size(), WORLD.Get_rank()


def expected_blocks(rpn: int) -> tuple:
    """What ``observed`` must say when the world is cut into consecutive blocks of ``rpn`` ranks."""
    first = RANK // rpn * rpn
    node_rank, node_size, num_nodes = RANK - first, min(rpn, P - first), -(-P // rpn)
    cross_size = len(range(node_rank, P, rpn))  # the ranks with this node-local index, one per node
    return rpn, node_rank, node_size, num_nodes, [(node_size, node_rank, cross_size)] * 2


def observed(comm: Communicator) -> tuple:
    """What the Communicator says (ranks_per_node, node_rank, node_size, num_nodes) and, for the node and
    cross-node communicators its blocking and non-blocking collectives use (collective on first use), their
    (node size, rank in the node, cross size)."""
    return (comm.ranks_per_node, comm.node_rank, comm.node_size, comm.num_nodes,
            [(t.node.size, t.node.rank, t.cross.size) for t in (comm._sync, comm._async)])


def assert_everywhere(got: tuple, want: tuple) -> None:
    """Collective: ``got == want`` on every rank (compared after gathering, so that all ranks fail together)."""
    everyone = run_gathered(lambda: (got, want))
    wrong = [(r, g, w) for r, (g, w) in enumerate(everyone) if g != w]
    assert not wrong, f"(rank, observed, expected): {wrong}"


@pytest.mark.parametrize("rpn", [1, 2, 3])
@pytest.mark.parametrize("source", ["argument", "env"])
def test_ranks_per_node_sets_the_layout(monkeypatch, source, rpn):
    if source == "env":
        monkeypatch.setenv("MPCOMM_RANKS_PER_NODE", str(rpn))
        comm = Communicator(WORLD)
    else:
        monkeypatch.delenv("MPCOMM_RANKS_PER_NODE", raising=False)
        comm = Communicator(WORLD, ranks_per_node=rpn)
    sub = comm.split(color=0)  # a sub-communicator keeps the setting
    try:
        got = in_step(lambda: (observed(comm), observed(sub), comm.selector.layout == Layout.blocks(P, rpn)))
    finally:
        sub.free()
        comm.free()
    assert_everywhere(got, (expected_blocks(rpn), expected_blocks(rpn), True))


def test_argument_overrides_env(monkeypatch):
    monkeypatch.setenv("MPCOMM_RANKS_PER_NODE", "1")
    comm = Communicator(WORLD, ranks_per_node=2)
    try:
        got = in_step(lambda: observed(comm))
    finally:
        comm.free()
    assert_everywhere(got, expected_blocks(2))


def test_detected_nodes_are_the_hosts(monkeypatch):
    """Without the setting, a node is the ranks on one host: compared with MPI's processor names."""
    monkeypatch.delenv("MPCOMM_RANKS_PER_NODE", raising=False)
    comm = Communicator(WORLD)
    try:
        got = in_step(lambda: observed(comm))
    finally:
        comm.free()
    hosts = WORLD.allgather(MPI.Get_processor_name())
    mates = [r for r in range(P) if hosts[r] == hosts[RANK]]
    leaders = [r for r in range(P) if hosts.index(hosts[r]) == r]
    index = mates.index(RANK)
    cross = sum(1 for leader in leaders if hosts.count(hosts[leader]) > index)  # nodes with a rank at this index
    assert_everywhere(got, (None, index, len(mates), len(leaders), [(len(mates), index, cross)] * 2))


@pytest.mark.parametrize("value", [0, -2])
def test_bad_ranks_per_node(monkeypatch, value):
    """Refused before any communication (every rank raises on its own)."""
    monkeypatch.delenv("MPCOMM_RANKS_PER_NODE", raising=False)
    with pytest.raises(ValueError, match=f"ranks_per_node must be >= 1, got {value}"):
        Communicator(WORLD, ranks_per_node=value)
    monkeypatch.setenv("MPCOMM_RANKS_PER_NODE", str(value))
    with pytest.raises(ValueError, match=f"ranks_per_node must be >= 1, got {value}"):
        Communicator(WORLD)


def test_ranks_sharing_cores_wait_with_shorter_spins():
    """More ranks than cores on a node: the collectives' transports yield the core sooner while waiting (the peer
    a collective waits for may need it); point to point, and every transport otherwise, keep the default spins."""
    from mpcomm import transport

    comm = Communicator(WORLD)
    try:
        shared = comm.ranks_per_core > 1
        expected = ((transport._SHARED_SPINS_BEFORE_YIELD, transport._SHARED_QUICK_TESTS) if shared
                    else (transport._SPINS_BEFORE_YIELD, transport._QUICK_TESTS))
        for t in (comm._sync, comm._async):
            assert (t.spins_before_yield, t.quick_tests) == expected, (comm.ranks_per_core, t)
        for t in (comm._p2p.envelopes, comm._p2p.payloads):
            assert (t.spins_before_yield, t.quick_tests) == (transport._SPINS_BEFORE_YIELD, transport._QUICK_TESTS)
        comm.allreduce(np.ones(3), algorithm="hierarchical")  # makes the node and cross-node transports: they inherit it
        for sub in (comm._sync._node, comm._sync._cross):
            assert (sub.spins_before_yield, sub.quick_tests) == expected
    finally:
        comm.free()
