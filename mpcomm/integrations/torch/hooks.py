"""mpcomm's wire compression as a torch DDP communication hook (for models trained with torch DDP on mpcomm)::

    from mpcomm.integrations.torch.hooks import WireState, wire_hook
    ddp.register_comm_hook(WireState("bf16", error_feedback=True), wire_hook)   # or "fp16", "int8"

Each bucket is averaged by its group's ``Communicator.allreduce(op="avg", wire=...)``: float32 accumulation, the
same bits on every rank, and compressed only where traffic crosses nodes (``mpcomm.compression``; one host sends
float32 and rounds the result once). Unlike torch's ``bf16_compress_hook``, nothing is cast on the rank and int8
(per-block scales) is offered.

:func:`bf16_compress_hook` is torch's own, for torch's CPU builds: their DDP refuses torch's
``bf16_compress_hook`` by its name (``DistributedDataParallel._check_comm_hook`` asks for CUDA and NCCL), though
the mpcomm backend (and gloo) all-reduce bfloat16 on the CPU.

``where_it_pays=True`` compresses a bucket only where the Communicator's cost model predicts the wire pays for its
size (``Selector.wire_pays``: the measured network and the codecs' rates; never on one host) and all-reduces it in
float32 elsewhere; the choice is the same on every rank.

Error feedback (``error_feedback=True``): each rank keeps what the codec's rounding takes from its bucket,
``x - roundtrip(x)``, and adds it to that bucket's next gradient, as PowerSGD does. That is exactly what the rank
lost where it is alone on its node; with several ranks on a node the node's sum is what gets rounded, and the
kept error is the rank's own estimate of its share.
"""
# No ``from __future__ import annotations``: DDP compares a hook's annotations with the classes themselves.
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ...compression import Codec, codec
from .group import BackendMpcomm

# torch built without CUDA/ROCm: its DDP refuses torch's bf16_compress_hook by name (use bf16_compress_hook here)
TORCH_REFUSES_BF16_HOOK: bool = torch.version.cuda is None and torch.version.hip is None


class WireState:
    """:func:`wire_hook`'s state: the codec, the group (None: the default group) and, with error feedback, the
    rounding error kept per parameter (so it survives DDP rebuilding its buckets after the first step)."""

    def __init__(self, wire: str, process_group: Optional[dist.ProcessGroup] = None,
                 error_feedback: bool = False, where_it_pays: bool = False) -> None:
        self.codec: Codec = codec(wire)  # ValueError naming the wires for an unknown one
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.where_it_pays = where_it_pays
        self.errors: Dict[int, torch.Tensor] = {}  # id(parameter) -> its kept error

    def fed_back(self, bucket: dist.GradBucket, compressed: bool = True) -> None:
        """Adds each parameter's kept error to its gradient in the bucket, and keeps the rounding error of what the
        bucket now holds (none where it goes uncompressed); the bucket's gradients are views of its buffer, in
        its order."""
        keys = [id(p) for p in bucket.parameters()]
        gradients = bucket.gradients()
        for key, grad in zip(keys, gradients):
            kept = self.errors.get(key)
            if kept is not None:
                grad.add_(kept)
        flat = bucket.buffer().detach().numpy().reshape(-1)
        error = torch.from_numpy(flat - self.codec.roundtrip(flat) if compressed else np.zeros_like(flat))
        start = 0
        for key, grad in zip(keys, gradients):
            self.errors[key] = error[start:start + grad.numel()].view_as(grad)
            start += grad.numel()


def wire_hook(state: WireState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket averaged over the group by mpcomm's compressed all-reduce."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, BackendMpcomm):
        raise TypeError(f"mpcomm wire_hook: process group {group.group_name!r} runs on "
                        f"{dist.get_backend(group)!r}; the hook needs the mpcomm backend")
    buffer = bucket.buffer()
    if buffer.dtype != torch.float32:
        raise TypeError(f"mpcomm wire_hook: bucket {bucket.index()} holds {buffer.dtype} gradients; the "
                        f"{state.codec.name} wire compresses float32 only")
    wire: Optional[str] = state.codec.name
    if state.where_it_pays and not backend.comm.selector.wire_pays(state.codec.name, buffer.numel() * 4):
        wire = None
    if state.error_feedback:
        state.fed_back(bucket, compressed=wire is not None)
    work = backend.allreduce_compressed(buffer, wire)
    return work.get_future().then(lambda fut: fut.value()[0])


def bf16_compress_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` itself, under a name DDP's CPU-build check lets through."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "mpcomm_bf16_compress_hook"
