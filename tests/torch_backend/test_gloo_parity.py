"""Every torch.distributed call on the mpcomm backend equals the same call on gloo, same inputs, same job.

Each test runs one program twice, on a fresh default group of gloo and then of mpcomm, and compares what
every call produced. Inputs are small integers (in every dtype), so every sum and product is exact in any order
of accumulation and the results must be identical bit for bit; ``test_random_floats`` adds random values, where
gloo and mpcomm may add in different orders from three ranks on (equal to rounding). Results that torch defines
on one rank only (``reduce`` off the root) are compared there only. Strided (non-contiguous) tensors are left out:
gloo all-reduces them wrongly (different results on different ranks); tests/torch_backend/test_backend.py checks them.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_gloo_parity.py`` (N >= 2).
"""
from __future__ import annotations

import pytest
from conftest import WORLD

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch_backend.groups import on_backend  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = [pytest.mark.torch, pytest.mark.mpi,
              pytest.mark.skipif(SIZE < 2, reason="compares multi-rank results"),
              pytest.mark.skipif(not dist.is_gloo_available(), reason="this PyTorch has no gloo")]
R = dist.ReduceOp
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


def assert_same(on_gloo: dict, on_mpcomm: dict, exact: bool = True) -> None:
    """The same calls, the same outputs (bitwise when ``exact``); lists every call that differs."""
    assert on_gloo.keys() == on_mpcomm.keys()
    differing = []
    for name, expected in on_gloo.items():
        got = on_mpcomm[name]
        if len(got) != len(expected) or any(g.dtype != e.dtype or g.shape != e.shape for g, e in zip(got, expected)):
            differing.append(f"{name}: shapes/dtypes {[(g.dtype, tuple(g.shape)) for g in got]} vs "
                             f"{[(e.dtype, tuple(e.shape)) for e in expected]}")
            continue
        for i, (g, e) in enumerate(zip(got, expected)):
            same = torch.equal(g, e) if exact else torch.allclose(g.double(), e.double(), rtol=0,
                                                                     atol=_ATOL[e.dtype])
            if not same:
                differing.append(f"{name}[{i}]: mpcomm {g.tolist()} gloo {e.tolist()}")
    assert not differing, f"rank {RANK}: differs from gloo — " + "; ".join(differing)


# Rounding of a sum of a few standard-normal values (a few units in the last place of the sum of magnitudes).
_ATOL = {torch.bfloat16: 0.1, torch.float32: 1e-5, torch.float64: 1e-13}


def values(n: int, dtype, salt: int = 0, rank: int = RANK) -> torch.Tensor:
    """Small integers (-3..4), different per rank and salt: every sum and product over up to 4 ranks, and every
    partial one, is exact in every dtype (bfloat16 holds the integers up to 256)."""
    return ((torch.arange(n, dtype=torch.int64) * (3 + salt) + 5 * rank + salt) % 8 - 3).to(dtype)


# ---------------------------------------------------------------------------------------------- the programs
def collectives(dtype, group=None):
    """Every collective on ``dtype`` tensors; returns {call: [output tensors]}."""
    me, p = dist.get_rank(group), dist.get_world_size(group)
    floating = dtype.is_floating_point
    out = {}
    ops = ["SUM", "PRODUCT", "MIN", "MAX"] + (["AVG"] if floating else ["BAND", "BOR", "BXOR"])
    for op in ops:
        for n in (0, 1, 7):
            t = values(n, dtype, salt=len(op), rank=me)
            dist.all_reduce(t, op=getattr(R, op), group=group)
            out[f"all_reduce {op} n={n}"] = [t]
    t = values(13, dtype, 1, me)
    dist.all_reduce(t, group=group, async_op=True).wait()
    out["all_reduce async"] = [t]
    root = p - 1
    t = values(6, dtype, 3, me)
    dist.broadcast(t, group_src=root, group=group)
    out["broadcast"] = [t]
    gathered = [torch.zeros(5, dtype=dtype) for _ in range(p)]
    dist.all_gather(gathered, values(5, dtype, 4, me), group=group)
    out["all_gather"] = gathered
    flat = torch.zeros(3 * p, dtype=dtype)
    dist.all_gather_single(flat, values(3, dtype, 5, me), group=group)
    out["all_gather_single"] = [flat]
    rs = torch.zeros(4, dtype=dtype)
    dist.reduce_scatter(rs, [values(4, dtype, 6 + r, me) for r in range(p)], group=group)
    out["reduce_scatter"] = [rs]
    rst = torch.zeros(2, dtype=dtype)
    dist.reduce_scatter_single(rst, values(2 * p, dtype, 7, me), op=R.MAX, group=group)
    out["reduce_scatter_single MAX"] = [rst]
    for op in ("SUM", "MAX"):
        t = values(5, dtype, 8, me)
        dist.reduce(t, group_dst=root, op=getattr(R, op), group=group)
        out[f"reduce {op} (root)"] = [t] if me == root else []
    gather_list = [torch.zeros(3, dtype=dtype) for _ in range(p)] if me == 0 else None
    dist.gather(values(3, dtype, 9, me), gather_list, group_dst=0, group=group)
    out["gather"] = gather_list or []
    scattered = torch.zeros(4, dtype=dtype)
    dist.scatter(scattered, [values(4, dtype, 10 + r, me) for r in range(p)] if me == root else None,
                 group_src=root, group=group)
    out["scatter"] = [scattered]
    a2a_out = [torch.zeros(2, dtype=dtype) for _ in range(p)]
    dist.all_to_all(a2a_out, [values(2, dtype, 11 + r, me) for r in range(p)], group=group)
    out["all_to_all"] = a2a_out
    single = torch.zeros(3 * p, dtype=dtype)
    dist.all_to_all_single(single, values(3 * p, dtype, 12, me), group=group)
    out["all_to_all_single even"] = [single]
    # uneven: rank i sends (i + j) % 3 rows of 2 columns to rank j (zeros included)
    send_splits = [(me + j) % 3 for j in range(p)]
    recv_splits = [(i + me) % 3 for i in range(p)]
    uneven = torch.full((sum(recv_splits), 2), -1, dtype=dtype)
    dist.all_to_all_single(uneven, values(2 * sum(send_splits), dtype, 13, me).reshape(-1, 2),
                           output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    out["all_to_all_single uneven"] = [uneven]
    dist.barrier(group=group)
    return out


def test_collectives_on_every_dtype():
    for dtype in DTYPES:
        program = lambda dtype=dtype: collectives(dtype)  # noqa: E731
        assert_same(on_backend("gloo", program), on_backend("mpcomm", program))


def test_bool_reductions():
    def program():
        out = {}
        for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
            t = torch.tensor([True, False, RANK == 0, RANK % 2 == 1, True])
            dist.all_reduce(t, op=getattr(R, op))
            out[op] = [t]
        return out

    assert_same(on_backend("gloo", program), on_backend("mpcomm", program))


def test_sub_groups():
    """new_group sub-groups: the collectives on a group of the even ranks and on one of the ranks in reverse."""
    evens = list(range(0, SIZE, 2)) if SIZE > 2 else [0, 1]

    def program():
        group = dist.new_group(evens)
        whole = dist.new_group(list(range(SIZE)))
        out = {}
        if RANK in evens:
            for dtype in (torch.float32, torch.int64):
                out.update({f"{dtype} {k}": v for k, v in collectives(dtype, group).items()})
        t = values(4, torch.float64, 1)
        dist.all_reduce(t, group=whole)
        out["whole"] = [t]
        return out

    assert_same(on_backend("gloo", program), on_backend("mpcomm", program))


def test_point_to_point_and_objects():
    def program():
        out = {}
        right, left = (RANK + 1) % SIZE, (RANK - 1) % SIZE
        got = torch.zeros(4, dtype=torch.bfloat16)
        works = [dist.irecv(got, src=left, tag=3), dist.isend(values(4, torch.bfloat16, 1), dst=right, tag=3)]
        for w in works:
            w.wait()
        out["ring isend/irecv"] = [got]
        batch = torch.zeros(3, dtype=torch.int64)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, values(3, torch.int64, 2), right),
                                         dist.P2POp(dist.irecv, batch, left)]):
            w.wait()
        out["batch_isend_irecv"] = [batch]
        if RANK == 0:
            sources = []
            for _ in range(SIZE - 1):
                t = torch.zeros(2)
                sources.append(dist.recv(t))
                assert t.tolist() == [float(sources[-1])] * 2
            out["recv from any source"] = [torch.tensor(sorted(sources))]
        else:
            dist.send(torch.full((2,), float(RANK)), dst=0)
            out["recv from any source"] = []
        objects = [None] * SIZE
        dist.all_gather_object(objects, {"rank": RANK, "text": "x" * RANK})
        out["all_gather_object"] = [torch.tensor([o["rank"] for o in objects])]
        gathered = [None] * SIZE if RANK == 0 else None
        dist.gather_object(("r", RANK), gathered, dst=0)
        out["gather_object"] = [torch.tensor([g[1] for g in gathered])] if RANK == 0 else []
        received = [None]
        dist.scatter_object_list(received, [i * 10 for i in range(SIZE)] if RANK == 1 else None, src=1)
        out["scatter_object_list"] = [torch.tensor(received)]
        shared = [RANK, "a"] if RANK == SIZE - 1 else [None, None]
        dist.broadcast_object_list(shared, src=SIZE - 1)
        out["broadcast_object_list"] = [torch.tensor([shared[0]])]
        return out

    assert_same(on_backend("gloo", program), on_backend("mpcomm", program))


def test_coalesced_calls():
    def program():
        out = {}
        tensors = [values(3, torch.float32, 1), values(5, torch.float32, 2)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in tensors:
                dist.all_reduce(t)
        cm.wait()
        out["coalescing_manager all_reduce"] = tensors
        outputs = [torch.zeros(2 * SIZE), torch.zeros(3 * SIZE)]
        with dist._coalescing_manager():
            for o, n in zip(outputs, (2, 3)):
                dist.all_gather_single(o, values(n, torch.float32, n))
        out["coalescing_manager all_gather_single"] = outputs
        reduced = [torch.zeros(2), torch.zeros(1)]
        with dist._coalescing_manager():
            for o in reduced:
                dist.reduce_scatter_single(o, values(o.numel() * SIZE, torch.float32, o.numel()))
        out["coalescing_manager reduce_scatter_single"] = reduced
        several = [values(4, torch.int64, 3), values(2, torch.int64, 4)]
        with pytest.warns(FutureWarning):
            dist.all_reduce_coalesced(several)
        out["all_reduce_coalesced"] = several
        lists = [[torch.zeros(2), torch.zeros(1)] for _ in range(SIZE)]  # (gloo refuses mixed dtypes here)
        with pytest.warns(FutureWarning):
            dist.all_gather_coalesced(lists, [values(2, torch.float32, 5), values(1, torch.float32, 6)])
        out["all_gather_coalesced"] = [t for pair in lists for t in pair]
        return out

    assert_same(on_backend("gloo", program), on_backend("mpcomm", program))


def test_random_floats():
    """Random values: equal to rounding (from three ranks on the two backends may add in different orders)."""
    def program():
        g = torch.Generator().manual_seed(RANK)
        out = {}
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            t = torch.randn(1000, generator=g).to(dtype)
            dist.all_reduce(t)
            rs = torch.zeros(100, dtype=dtype)
            dist.reduce_scatter_single(rs, torch.randn(100 * SIZE, generator=g).to(dtype))
            out[f"{dtype} all_reduce"], out[f"{dtype} reduce_scatter_single"] = [t], [rs]
        return out

    on_gloo, on_mpcomm = on_backend("gloo", program), on_backend("mpcomm", program)
    assert_same(on_gloo, on_mpcomm, exact=SIZE <= 2)
