"""The network probe (mpcomm.topology) and the cost model's network terms (bytes per node link).

Serial:  python -m pytest -q tests/test_topology.py
MPI:     timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_topology.py   (N = 1..4)
On one host the probe is exercised directly (over shared memory); tests/cluster/ checks it across real nodes.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import WORLD, assert_identical_across_ranks, without_rank

from mpcomm import Communicator
from mpcomm.algorithms import ALLREDUCE
from mpcomm.algorithms.auto import STEADY, STEADY_MARGIN, CostModel, Layout, Selector
from mpcomm.topology import NetworkMeasurement, measure, ranks_per_core

P = WORLD.Get_size()
GIGABIT = NetworkMeasurement(latency=20e-6, seconds_per_byte=8 / 0.95e9, probe_bytes=1 << 20, seconds=0.01)


# ------------------------------------------------------------------------------------------ model (serial)
def test_ranks_per_core_is_the_most_crowded_machines():
    """Ranks are counted per machine (however many nodes they make there) over the union of the CPUs they may run
    on; the most crowded machine decides."""
    assert ranks_per_core([("a", [0, 1]), ("a", [0, 1]), ("b", [0, 1]), ("b", [0, 1])]) == 1.0
    assert ranks_per_core([("a", [0, 1])] * 4) == 2.0  # (two nodes of two on one machine of two cores)
    assert ranks_per_core([("a", [0]), ("a", [1]), ("a", [1]), ("b", [0, 1, 2, 3])]) == 1.5
    assert ranks_per_core([("a", [0]), ("a", [1]), ("b", [5])]) == 1.0


def test_with_network_sets_the_network_terms_only():
    model = CostModel().with_network(GIGABIT)
    assert (model.alpha_net, model.beta_net) == (GIGABIT.latency, GIGABIT.seconds_per_byte)
    assert replace(model, alpha_net=CostModel.alpha_net, beta_net=CostModel.beta_net) == CostModel()
    assert "0.95 Gbit/s" in str(GIGABIT)


@pytest.mark.parametrize("node_sizes, factors", [
    ((2, 2), {"ring": 1.5, "rhd": 2.0, "hierarchical": 1.0, "native": 1.1}),  # native: + its node's tree, scaled
    ((1, 1, 1, 1), {"ring": 1.5, "rhd": 1.5, "hierarchical": 1.5, "native": 1.5}),
])
def test_slow_network_costs_are_the_bytes_on_each_nodes_link(node_sizes, factors):
    """At a size where the network term dominates, each algorithm costs (bytes its node's link carries) x
    beta_net: the factors counted by hand (and on the NIC counters in tests/cluster); the rest, a few %, is
    the intra-node part. ``native`` too: its shared-memory byte scale does not slow the link."""
    model, n = CostModel().with_network(GIGABIT), float(1 << 30)
    layout = Layout(sum(node_sizes), node_sizes)
    for algorithm, factor in factors.items():
        assert model.allreduce(algorithm, n, layout) / (n * GIGABIT.seconds_per_byte) == pytest.approx(factor, rel=0.05)


def test_measured_gigabit_network_prefers_node_aware_algorithms():
    """1 Gbit/s between nodes of 2 ranks: a node-aware algorithm (the link carries n) from 64 KiB, the MPI
    library's at 64 KiB (fewer Python steps, the same bytes) and hierarchical from 256 KiB, where the default
    100 Gb/s-class model keeps the flat algorithms that load each link with 1.5-2 n."""
    candidates = {"allreduce": tuple(ALLREDUCE)}
    measured = Selector(Layout(4, (2, 2)), candidates, CostModel().with_network(GIGABIT), network=GIGABIT)
    assumed = Selector(Layout(4, (2, 2)), candidates)
    sizes = [1 << k for k in range(16, 27, 2)]
    assert [measured.predict("allreduce", n) for n in sizes] == ["native"] + ["hierarchical"] * (len(sizes) - 1)
    assert assumed.predict("allreduce", 1 << 26) != "hierarchical"


def test_across_nodes_a_ring_within_the_margin_is_preferred():
    """4 nodes of 1 rank at 1 Gbit/s: every scheme but the tree moves 1.5 n per link; from 1 MiB the model
    prices them within 1 % and the ring family (same two peers all call long) is taken over the cheapest,
    which changes partner every round; at 64 KiB the ring's 2(p-1) steps cost more than the margin."""
    candidates = {"allreduce": tuple(ALLREDUCE)}
    model = CostModel().with_network(GIGABIT)
    flat = Selector(Layout(4, (1, 1, 1, 1)), candidates, model)
    for n in (1 << 20, 1 << 22):
        costs = {a: model.allreduce(a, n, flat.layout) for a in ALLREDUCE}
        assert min(costs, key=costs.get) not in STEADY  # the rule, not the raw minimum, picks the ring here
        choice = flat.predict("allreduce", n)
        assert choice in STEADY and costs[choice] <= min(costs.values()) * (1 + STEADY_MARGIN)
    assert flat.predict("allreduce", 1 << 26) in STEADY
    assert flat.predict("allreduce", 1 << 16) not in STEADY
    one_host = Selector(Layout(4, (4,)), candidates)  # no connections to keep warm: the raw minimum
    for n in (1 << 16, 1 << 20, 1 << 22):
        costs = {a: one_host.model.allreduce(a, n, one_host.layout) for a in ALLREDUCE}
        assert one_host.predict("allreduce", n) == min(costs, key=costs.get)


# ------------------------------------------------------------------------------------------ probe (MPI, one host)
@pytest.mark.mpi
def test_one_host_pays_for_no_probe():
    """Nodes simulated with ranks_per_node on one host share its memory: nothing is measured."""
    comm = Communicator(WORLD, ranks_per_node=1)
    assert comm.num_nodes == P and comm.selector.network is None
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_probe_measures_and_every_rank_agrees():
    comm = Communicator(WORLD)
    network = measure(comm._sync, host=comm.rank // 2)  # pretend hosts of 2 ranks: leaders 0-2, ... exchange
    if P <= 2:
        assert network is None
    else:
        assert network.latency > 0 and network.seconds_per_byte > 0 and network.seconds > 0
        assert network.probe_bytes >= 256 << 10
        assert_identical_across_ranks(np.array([network.latency, network.seconds_per_byte, network.probe_bytes,
                                                network.seconds]), "network measurement")
    assert measure(comm._sync) is None  # by processor name: one host
    comm.free()


@pytest.mark.mpi(min_size=2)
def test_probe_with_a_silent_partner_times_out():
    """Rank 1 never joins the probe: every other rank raises CommTimeoutError within timeout + 5 s."""
    comm = Communicator(WORLD, timeout=1.0)
    for rank, result in enumerate(without_rank(1, lambda: measure(comm._sync, host=comm.rank))):
        if rank != 1:
            assert result != "completed without rank 1" and "network probe" in result[0] and result[1] < 6.0, \
                (rank, result)
