"""PowerSGD's reduction (Vogels et al., 2019; torch's ``powerSGD_hook``), shared by DDP's buckets and FSDP's units.

Each gradient of >= 2 dims, seen as a matrix M (first dim x the rest) that rank R shrinks by at least
:data:`MIN_COMPRESSION_RATE`, is sent as P = M Q (summed over the ranks, then orthonormalized) and Q = M^T P
(averaged); the result, the same on every rank, is P Q^T. Q is kept and warm-starts the next step. Everything else
(vectors, matrices too small, DDP's unused-parameter flags) is averaged exactly in the same all-reduce as P.
The callers own the error feedback and what they keep of the result (DDP: all of it; FSDP: the rank's shard).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import numpy as np

from ..comm import Communicator
from ..nn.backend import array_module
from ..work import Work

__all__ = ["MIN_COMPRESSION_RATE", "matrix_dims", "reduce_powersgd", "orthogonalize"]

MIN_COMPRESSION_RATE = 2.0  # torch's PowerSGDState default: compress a matrix only if it halves its bytes


def matrix_dims(shape: Sequence[int], rank: int) -> tuple[int, int, int] | None:
    """(n, m, r) of a gradient of ``shape`` as an n x m matrix if PowerSGD at ``rank`` compresses it, else None."""
    if len(shape) < 2:
        return None
    n, m = int(shape[0]), int(np.prod(shape[1:]))
    r = min(n, m, rank)
    return (n, m, r) if n * m > (n + m) * r * MIN_COMPRESSION_RATE else None


def initial_q(seed: int, m: int, r: int, dtype: Any, xp: Any) -> Any:
    """The same random orthonormal m x r Q on every rank, seeded by the parameter's index in its model."""
    q = np.random.default_rng([29, seed]).standard_normal((m, r))
    return xp.asarray(orthogonalize(q).astype(dtype))


def orthogonalize(p: Any) -> Any:
    """Orthonormal columns spanning ``p``'s (Householder QR, signs fixed so the diagonal of R is >= 0)."""
    xp = array_module(p)
    q, r = xp.linalg.qr(p)
    signs = xp.where(xp.diag(r) < 0, -1, 1).astype(p.dtype)
    return q * signs


def reduce_powersgd(comm: Communicator, grads: Sequence[tuple[Hashable, int, Any]], rank: int, q: dict,
                    extra: Sequence[Any] = ()) -> tuple[Work, Callable[[], None]]:
    """Start reducing ``grads`` — ``(key, seed, gradient view)`` triples — in place over ``comm``, plus the flat
    arrays ``extra`` averaged exactly. ``q`` maps key -> Q (created from ``seed`` the first time) and is updated.
    Returns the first all-reduce's Work and what finishes once it is done: the exact parts averaged, the Q
    all-reduce (blocking), every compressed gradient overwritten with P Q^T."""
    xp, size = array_module(grads[0][2]), comm.size
    dtype = grads[0][2].dtype
    matrices, exact = [], []
    for key, seed, grad in grads:
        dims = matrix_dims(grad.shape, rank)
        if dims is None:
            exact.append(grad.reshape(-1))
            continue
        n, m, r = dims
        if key not in q:
            q[key] = initial_q(seed, m, r, dtype, xp)
        matrices.append((key, grad.reshape(n, m), r))
    exact += [e for e in extra if e.size]
    n_exact = sum(int(v.size) for v in exact)
    p_sizes = [mat.shape[0] * r for _, mat, r in matrices]
    first = xp.empty(n_exact + sum(p_sizes), dtype=dtype)  # [exact gradients | P of every matrix]
    if exact:
        xp.concatenate(exact, out=first[:n_exact])
    ps, offset = [], n_exact
    for (key, mat, r), k in zip(matrices, p_sizes):
        p = first[offset: offset + k].reshape(mat.shape[0], r)
        xp.matmul(mat, q[key], out=p)
        ps.append(p)
        offset += k
    work = comm.iallreduce(first, op="sum")

    def finish() -> None:
        exact_avg = first[:n_exact] / size
        at = 0
        for v in exact:
            v[...] = exact_avg[at: at + v.size].reshape(v.shape)
            at += v.size
        qs = xp.empty(sum(mat.shape[1] * r for _, mat, r in matrices), dtype=dtype)
        q_views, at = [], 0
        for (key, mat, r), p in zip(matrices, ps):
            p[...] = orthogonalize(p)
            new_q = qs[at: at + mat.shape[1] * r].reshape(mat.shape[1], r)
            xp.matmul(mat.T, p, out=new_q)
            q_views.append(new_q)
            at += new_q.size
        if qs.size:
            comm.allreduce(qs, op="sum")
            qs /= size
        for (key, mat, _), p, new_q in zip(matrices, ps, q_views):
            xp.matmul(p, new_q.T, out=mat)
            q[key] = new_q.copy()

    return work, finish
