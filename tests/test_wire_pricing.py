"""Pricing of compression="auto" (``Selector.wire_pays``): the cost model of ``auto`` with and without a wire.

One host never pays (the rule, whatever the size); across a measured slow link a wire pays above a crossover
and the crossover falls as the link slows; with the model's default 100 Gb/s-class network it never pays.
The measured crossovers are in bench/results/compression.md.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import WORLD, run_gathered

from mpcomm.algorithms import REGISTRY
from mpcomm.algorithms.auto import WIRE_MARGIN, CostModel, Layout, Selector
from mpcomm.compression import WIRES
from mpcomm.topology import NetworkMeasurement

SIZES = [1 << k for k in range(3, 31)]
CANDIDATES = {operation: tuple(algorithms) for operation, algorithms in REGISTRY.items()}


def selector(layout: Layout, gbit: float | None) -> Selector:
    model = CostModel()
    if gbit is not None:
        model = model.with_network(NetworkMeasurement(latency=50e-6, seconds_per_byte=8 / (gbit * 1e9),
                                                      probe_bytes=1 << 22, seconds=0.05))
    return Selector(layout, CANDIDATES, model)


@pytest.mark.parametrize("layout", [Layout(1, (1,)), Layout(2, (2,)), Layout(4, (4,)), Layout(3, (3,))])
@pytest.mark.parametrize("wire", WIRES)
def test_one_host_never_pays(layout, wire):
    s = selector(layout, 1.0)
    assert not any(s.wire_pays(wire, n) for n in SIZES)


@pytest.mark.parametrize("layout", [Layout(2, (1, 1)), Layout(4, (2, 2)), Layout(4, (1, 1, 1, 1)), Layout(6, (3, 3))])
@pytest.mark.parametrize("wire", WIRES)
def test_slow_link_pays_above_a_crossover(layout, wire):
    s = selector(layout, 1.0)
    crossover = s.wire_crossover(wire, SIZES)
    assert crossover is not None and 1 << 10 <= crossover <= 1 << 22, crossover
    assert [s.wire_pays(wire, n) for n in SIZES] == [n >= crossover for n in SIZES]
    with_wire, without = s.price_wire(wire, 64 << 20)
    assert with_wire < (1 - WIRE_MARGIN) * without
    slower = selector(layout, 0.1).wire_crossover(wire, SIZES)
    assert slower is not None and slower <= crossover


@pytest.mark.parametrize("wire", WIRES)
def test_fast_network_does_not_pay(wire):
    assert selector(Layout(4, (2, 2)), None).wire_crossover(wire, SIZES) is None  # the default 100 Gb/s-class model
    assert selector(Layout(2, (1, 1)), 100.0).wire_crossover(wire, SIZES) is None


def test_int8_pays_before_bf16():
    s = selector(Layout(2, (1, 1)), 1.0)
    assert s.price_wire("int8", 64 << 20)[0] < s.price_wire("bf16", 64 << 20)[0]


@pytest.mark.mpi
def test_auto_is_off_on_this_host_on_every_rank(comm):
    """Under mpiexec on one machine every rank says no, for every wire and size (ranks_per_node unset)."""
    if comm.num_nodes != 1:
        pytest.skip("the ranks span hosts")
    answers = run_gathered(lambda: [comm.selector.wire_pays(w, n) for w in WIRES for n in SIZES])
    assert not any(np.concatenate(answers)), "a wire paid on one host"
    assert WORLD.Get_size() == len(answers)
