"""Hierarchical (two-level) all-reduce: fast links inside a node, few messages between nodes.

With q ranks on every node (the usual case), as in NCCL/Horovod's hierarchical all-reduce:

1. intra-node ring reduce-scatter: node-local rank i ends with chunk i of the node's sum;
2. inter-node all-reduce of chunk i among the ranks with node-local index i, one per node (``t.cross``),
   by recursive halving/doubling — the q peer groups run concurrently, each on 1/q of the data;
3. intra-node ring all-gather of the q finished chunks.

When nodes differ in size (say 3 ranks at 2 per node: nodes of 2 and 1) the peer groups would hold
different chunkings, so the leader variant is used instead: binomial reduce to node-local rank 0,
all-reduce among the node leaders, binomial broadcast inside the node. Every rank of the communicator
takes the same branch, because it is decided from the sizes of all nodes.

Either way each element is finished by exactly one inter-node group and then copied, so the result is
bitwise identical on every rank. The node layout is ``Transport.node`` / ``Transport.cross`` (shared
memory, or blocks of ``ranks_per_node`` consecutive ranks to simulate nodes on one host).
"""
from __future__ import annotations

from ..buffers import ReduceOp
from ..transport import Transport
from . import rhd, ring, tree
from .chunks import chunk_bounds


def allreduce(t: Transport, buf, op: ReduceOp) -> None:
    node, cross = t.node, t.cross
    with node.running(t.operation), cross.running(t.operation):
        if t.nodes_are_uniform:
            bounds = chunk_bounds(buf.size, node.size)
            mine = buf[slice(*bounds[node.rank])]
            with t.phase("reduce-scatter (in the node)"):
                ring.reduce_scatter_chunks(node, buf, mine, op, bounds)
            with t.phase("all-reduce (between nodes)"):
                rhd.allreduce(cross, mine, op)
            with t.phase("all-gather (in the node)"):
                ring.all_gather_chunks(node, buf, bounds)
        else:
            with t.phase("reduce (to the node's leader)"):
                tree.reduce(node, buf, op, root=0)
            with t.phase("all-reduce (between the leaders)"):
                if node.rank == 0:
                    rhd.allreduce(cross, buf, op)
            with t.phase("broadcast (in the node)"):
                tree.broadcast(node, buf, root=0)
