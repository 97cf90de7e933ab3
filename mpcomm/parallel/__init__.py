"""Training engines built on the Communicator: data, fully-sharded, pipeline and tensor parallel.

Engine protocol (DDP and FSDP): ``forward(x) -> (y, ctx)``, ``backward(grad_y, ctx) -> grad_x`` (gradients are
synchronized when it returns), ``parameters()``, ``zero_grad()``, ``full_state_dict()``, ``module``.
"""
from __future__ import annotations

from .ddp import DistributedDataParallel, UnusedParameterError
from .fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy
from .pipeline import PipelineParallel
from .tensor import ColumnParallelLinear, RowParallelLinear, TensorParallelMLPBlock, VocabParallelEmbedding

__all__ = [
    "DistributedDataParallel",
    "UnusedParameterError",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardingStrategy",
    "BackwardPrefetch",
    "PipelineParallel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelMLPBlock",
    "VocabParallelEmbedding",
]
