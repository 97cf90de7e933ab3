"""The pipeline's activation shapes, inferred once by a stage-ordered handshake (see docs/pipeline.md).

Every stage runs its chunk on a zero-row input of the received feature shape (eval mode, so no RNG advances) and
sends ``(dtype, ndim, *shape)`` of its output to the next stage, so that both sides of every hand-off know its size.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from mpcomm.buffers import BFLOAT16
from mpcomm.errors import ConfigError
from mpcomm.nn.backend import array_module

__all__ = ["StageShapes", "infer_shapes", "chunk_array_module"]

# stage -> (input shape, input dtype, output shape, output dtype)
StageShapes = dict[int, tuple[tuple, Any, tuple, Any]]

_META_LEN = 10  # dtype index, ndim, up to 8 dims
_DTYPES = tuple(np.dtype(t) for t in (np.float64, np.float32, np.float16, BFLOAT16, np.complex64, np.complex128,
                                       np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_))


def infer_shapes(comm: Any, chunks: Sequence[Any], stages: Sequence[int], num_stages: int, first_input: Any,
                 meta_tag: Callable[[int], int]) -> StageShapes:
    """``(rows, *features, dtype)`` of every local stage's input and output; collective over the pp
    Communicator ``comm``. ``first_input``: a micro-batch of x where stage 0 is local; ``meta_tag(s)``: the tag
    of stage ``s``'s message to stage ``s + 1``."""
    pp, rank = comm.size, comm.rank
    shapes: StageShapes = {}
    pending = []
    prev_out: tuple[tuple, Any] = ((), None)  # output meta of the previous stage when it is local (pp == 1)
    for s in stages:
        if s == 0:
            in_shape, in_dtype = tuple(first_input.shape), first_input.dtype
        elif (s - 1) % pp == rank:
            in_shape, in_dtype = prev_out
        else:
            meta = np.zeros(_META_LEN, dtype=np.int64)
            comm.recv(meta, (s - 1) % pp, tag=meta_tag(s - 1))
            in_shape, in_dtype = tuple(int(d) for d in meta[2:2 + meta[1]]), _DTYPES[int(meta[0])]
        out_shape, out_dtype = _probe(chunks[s], in_shape, in_dtype)
        shapes[s] = (in_shape, in_dtype, out_shape, out_dtype)
        prev_out = (out_shape, out_dtype)
        if s < num_stages - 1 and (s + 1) % pp != rank:
            if len(out_shape) > _META_LEN - 2:
                raise ConfigError(f"pipeline activations may have at most {_META_LEN - 2} dims, got {out_shape}")
            meta = np.zeros(_META_LEN, dtype=np.int64)
            meta[0], meta[1] = _dtype_index(out_dtype), len(out_shape)
            meta[2:2 + len(out_shape)] = out_shape
            pending.append((comm.isend(meta, (s + 1) % pp, tag=meta_tag(s)), meta))
    for w, _ in pending:
        w.wait()
    return shapes


def chunk_array_module(chunk: Any) -> Any:
    """numpy or cupy: where ``chunk``'s parameters live."""
    params = chunk.parameters()
    return array_module(params[0].data) if params else np


def _probe(chunk: Any, in_shape: tuple, in_dtype: Any) -> tuple[tuple, Any]:
    """Output shape of ``chunk`` for a micro-batch of ``in_shape``: run it on a zero-row input, eval mode."""
    xp = chunk_array_module(chunk)
    modes = [(m, m.training) for m in chunk.modules()]
    chunk.train(False)
    try:
        y, _ = chunk.forward(xp.zeros((0,) + tuple(in_shape[1:]), dtype=in_dtype))
    finally:
        for m, mode in modes:
            object.__setattr__(m, "training", mode)
    return (in_shape[0],) + tuple(y.shape[1:]), y.dtype


def _dtype_index(dtype: Any) -> int:
    names = tuple(d.name for d in _DTYPES)  # by name: a byte-swapped float64 travels as float64 too
    name = np.dtype(dtype).name
    if name not in names:
        raise ConfigError(f"pipeline activations of dtype {name} are not supported; use one of {names}")
    return names.index(name)
