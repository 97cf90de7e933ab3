"""Hierarchical all-reduce on simulated node layouts, against MPI's own Allreduce, bitwise identical on all ranks.

``ranks_per_node`` cuts the world into consecutive blocks, so one host runs: 2 nodes of 2 at 4 ranks, uneven
nodes (2 + 1) at 3 ranks (the leader variant), one rank per node, and one node holding everyone.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/test_hierarchical.py`` (any N >= 1).
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import WORLD, BFLOAT16, assert_identical_across_ranks, assert_reduced, gather, in_step, make_input
from mpi4py import MPI

from mpcomm import Communicator
from mpcomm.algorithms.auto import Layout

pytestmark = pytest.mark.mpi

P = WORLD.Get_size()
LAYOUTS = {"one-per-node": 1, "two-per-node": 2, "all-in-one": P}
SIZES = sorted({0, 1, 2, 7, P + 1, 1009, 100_003})


@pytest.fixture(scope="module", params=list(LAYOUTS), ids=list(LAYOUTS))
def layout_comm(request):
    comm = Communicator(WORLD, ranks_per_node=LAYOUTS[request.param])
    yield comm
    comm.free()


def _mpi_allreduce(x: np.ndarray, op: str) -> np.ndarray:
    out = np.empty_like(x)
    WORLD.Allreduce(x, out, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op])
    return out


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (np.float64, "sum"), (np.int32, "sum"), (np.int64, "max")])
def test_matches_mpi_allreduce(layout_comm, n, dtype, op):
    x = make_input(dtype, op, (n,), WORLD.Get_rank(), seed=n)
    expected = _mpi_allreduce(x, op)
    y = x.copy()
    in_step(lambda: layout_comm.allreduce(y, op=op, algorithm="hierarchical"))
    assert_identical_across_ranks(y, "hierarchical allreduce")
    assert_reduced(y, gather(x), op, expected=expected, what="hierarchical vs MPI Allreduce:")


@pytest.mark.parametrize(
    "dtype, op", [(np.float16, "avg"), (BFLOAT16, "sum"), (np.complex64, "prod"), (np.bool_, "min")]
)
def test_other_dtypes_and_shapes(layout_comm, dtype, op):
    x = make_input(dtype, op, (3, 5, 7), WORLD.Get_rank(), seed=3)
    y = x.copy()
    in_step(lambda: layout_comm.allreduce(y, op=op, algorithm="hierarchical"))
    assert_identical_across_ranks(y, "hierarchical allreduce")
    assert_reduced(y, gather(x), op, what="hierarchical:")


def test_layout_and_branch(layout_comm):
    """The uniform (reduce-scatter / cross all-reduce / all-gather) path is taken exactly when all nodes are
    the same size; otherwise the leader path. Layout is the same on every rank."""
    rpn = layout_comm.ranks_per_node
    uniform = in_step(lambda: layout_comm._sync.nodes_are_uniform)
    assert uniform == (P % rpn == 0 or P <= rpn)
    assert layout_comm.selector.layout == Layout.blocks(P, rpn)
    assert layout_comm.num_nodes == -(-P // rpn)
    assert WORLD.allgather(uniform) == [uniform] * P


def test_uneven_nodes_need_three_ranks():
    if P != 3:
        pytest.skip("the 2 + 1 layout needs exactly 3 ranks (it is also covered by two-per-node at 3 ranks)")
    comm = Communicator(WORLD, ranks_per_node=2)
    assert comm.selector.layout.node_sizes == (2, 1)
    x = np.arange(10_001, dtype=np.float64) * (comm.rank + 1) / 7
    y = x.copy()
    in_step(lambda: comm.allreduce(y, algorithm="hierarchical"))
    assert_identical_across_ranks(y)
    assert_reduced(y, gather(x), "sum", expected=_mpi_allreduce(x, "sum"))
    comm.free()


def test_sub_communicator_and_nonblocking():
    """On a split communicator (own layout) and through the progress thread (its own transport and split)."""
    comm = Communicator(WORLD, ranks_per_node=2)
    sub = comm.split(color=comm.rank % 2)
    x = make_input(np.float32, "sum", (4099,), comm.rank, seed=11)
    y, z = x.copy(), x.copy()
    in_step(lambda: sub.allreduce(y, algorithm="hierarchical"))
    work = comm.iallreduce(z, algorithm="hierarchical")
    in_step(work.wait)
    mates = [r for r in range(P) if r % 2 == comm.rank % 2]
    everyone = gather(x)
    assert_reduced(y, [everyone[r] for r in mates], "sum", what="hierarchical on split:")
    assert_reduced(z, everyone, "sum", what="hierarchical iallreduce:")
    assert_identical_across_ranks(z)
    sub.free()
    comm.free()
