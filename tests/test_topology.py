"""The network probe (mpcomm.topology) and the cost model's network terms (bytes per node link).

Serial:  python -m pytest -q tests/test_topology.py
MPI:     timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_topology.py   (N = 1..4)
On one host the probe is exercised directly (over shared memory); tests/cluster/ checks it across real nodes.
"""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import WORLD, assert_identical_across_ranks, run_gathered

from mpcomm import Communicator, CommTimeoutError
from mpcomm.algorithms import ALLREDUCE
from mpcomm.algorithms.auto import CostModel, Layout, Selector
from mpcomm.topology import NetworkMeasurement, measure

P = WORLD.Get_size()
GIGABIT = NetworkMeasurement(latency=20e-6, seconds_per_byte=8 / 0.95e9, probe_bytes=1 << 20, seconds=0.01)


# ------------------------------------------------------------------------------------------ model (serial)
def test_with_network_sets_the_network_terms_only():
    model = CostModel().with_network(GIGABIT)
    assert (model.alpha_net, model.beta_net) == (GIGABIT.latency, GIGABIT.seconds_per_byte)
    assert replace(model, alpha_net=CostModel.alpha_net, beta_net=CostModel.beta_net) == CostModel()
    assert "0.95 Gbit/s" in str(GIGABIT)


@pytest.mark.parametrize("node_sizes, factors", [
    ((2, 2), {"ring": 1.5, "rhd": 2.0, "hierarchical": 1.0}),
    ((1, 1, 1, 1), {"ring": 1.5, "rhd": 1.5, "hierarchical": 1.5}),
])
def test_slow_network_costs_are_the_bytes_on_each_nodes_link(node_sizes, factors):
    """At a size where the network term dominates, each algorithm costs (bytes its node's link carries) x
    beta_net: the factors counted by hand (and on the NIC counters in tests/cluster); the rest, a few %, is
    the intra-node part."""
    model, n = CostModel().with_network(GIGABIT), float(1 << 30)
    layout = Layout(sum(node_sizes), node_sizes)
    for algorithm, factor in factors.items():
        assert model.allreduce(algorithm, n, layout) / (n * GIGABIT.seconds_per_byte) == pytest.approx(factor, rel=0.05)


def test_measured_gigabit_network_prefers_node_aware_algorithms():
    """1 Gbit/s between nodes of 2 ranks: hierarchical (the link carries n) from 64 KiB, where the default
    100 Gb/s-class model keeps the flat algorithms that load each link with 1.5-2 n."""
    candidates = {"allreduce": tuple(ALLREDUCE)}
    measured = Selector(Layout(4, (2, 2)), candidates, CostModel().with_network(GIGABIT), network=GIGABIT)
    assumed = Selector(Layout(4, (2, 2)), candidates)
    sizes = [1 << k for k in range(16, 27, 2)]
    assert [measured.predict("allreduce", n) for n in sizes] == ["hierarchical"] * len(sizes)
    assert assumed.predict("allreduce", 1 << 26) != "hierarchical"
    flat = Selector(Layout(4, (1, 1, 1, 1)), candidates, CostModel().with_network(GIGABIT))
    assert {flat.predict("allreduce", n) for n in sizes} <= {"rhd", "hierarchical", "ring", "ring_pipelined"}


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

    def run():
        if comm.rank == 1:
            return None
        start = time.monotonic()
        try:
            measure(comm._sync, host=comm.rank)
        except CommTimeoutError as exc:
            return "network probe" in str(exc), time.monotonic() - start
        return "completed without rank 1"

    for rank, result in enumerate(run_gathered(run)):
        if rank != 1:
            assert result != "completed without rank 1" and result[0] and result[1] < 6.0, (rank, result)
