"""The mpcomm backend bound to the CPU device as torch binds gloo, and what torch builds on that binding:
``_get_backend(cpu)``, ``_device_types``, ``"cpu:mpcomm"`` / ``"cpu:mpcomm,cuda:nccl"`` strings and
``dist.get_backend()`` against gloo's; ``batch_isend_irecv``, ``send/recv_object_list`` and a receive from any source
against the values sent; ``monitored_barrier`` with a rank that never arrives (a named error, within the timeout);
DCP ``async_save`` of a sharded model, loaded back at another layout, against the model's full parameters.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_device_binding.py``
(any N; ``make test-torch`` runs N = 1, 2, 3 on every torch it tests).
"""
from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from datetime import timedelta

import pytest
from conftest import WORLD, in_step, run_gathered

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import mpcomm.integrations.torch as mpt  # noqa: E402
from torch_backend.groups import backend_of, on_backend  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = [pytest.mark.torch, pytest.mark.mpi]
multi = pytest.mark.skipif(SIZE < 2, reason="needs several ranks")
# torch 2.13's dist.monitored_barrier refuses every backend not named "gloo"; 2.14's asks for a CPU backend.
MONITORED_BARRIER_BY_NAME = torch.torch_version.TorchVersion(torch.__version__) < "2.14"
# torch 2.15's dist.split_group splits a CPU group whose backend supports splitting; 2.13's and 2.14's split only a
# group bound to an accelerator.
SPLITS_CPU_GROUPS = torch.torch_version.TorchVersion(torch.__version__) >= "2.15"
no_accelerator = pytest.mark.skipif(torch.accelerator.is_available(), reason="torch splits the accelerator's backend")


# ============================================================================ the binding, against gloo's
def _binding(spec: str) -> dict:
    """init_process_group(spec) over every rank: how torch sees the group, or the error it raised."""
    backend = "gloo" if "gloo" in spec else "mpcomm"
    if backend == "gloo":
        init = mpt.gloo_init_args()
    else:
        init = {"init_method": "mpcomm://"}
    try:
        dist.init_process_group(spec, timeout=timedelta(seconds=60), **init)
    except Exception as exc:  # noqa: BLE001 - compared with gloo's
        return {"error": type(exc).__name__}
    try:
        group = dist.group.WORLD
        cpu = group._get_backend(torch.device("cpu"))
        t = torch.arange(5.0) + RANK
        dist.all_reduce(t)
        return {"devices": [d.type for d in group._device_types], "get_backend": str(dist.get_backend()),
                "cpu backend": type(cpu).__name__, "sum": t.tolist(),
                "sub-group backend": dist.get_backend(dist.new_group(list(range(SIZE))))}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spec", ["{}", "cpu:{}", "cpu:{},cuda:nccl"])
def test_bound_to_cpu_as_gloo_is(spec):
    gloo, mpcomm = in_step(lambda: _binding(spec.format("gloo"))), in_step(lambda: _binding(spec.format("mpcomm")))
    if "error" in gloo:  # e.g. "cuda:nccl" on a torch without NCCL: mpcomm's refusal is torch's, as gloo's
        assert mpcomm == gloo
        return
    assert mpcomm["cpu backend"] == "BackendMpcomm" and gloo["cpu backend"] == "ProcessGroupGloo"
    # gloo also takes cuda tensors, so a bare "gloo" binds cuda too; mpcomm binds cpu alone (cuda to nccl if named)
    cuda_named = {"cuda"} if "cuda:" in spec else set()
    assert set(mpcomm["devices"]) == (set(gloo["devices"]) - {"cuda"}) | cuda_named and "cpu" in mpcomm["devices"]
    assert mpcomm["get_backend"] == gloo["get_backend"].replace("gloo", "mpcomm")
    assert mpcomm["sub-group backend"] == gloo["sub-group backend"].replace("gloo", "mpcomm")
    assert mpcomm["sum"] == gloo["sum"] == [float(i * SIZE + SIZE * (SIZE - 1) // 2) for i in range(5)]


def _split_group_error() -> str:
    try:
        dist.split_group(split_ranks=[list(range(SIZE))])
    except RuntimeError as exc:
        return str(exc)
    return "split"


@no_accelerator
@pytest.mark.skipif(SPLITS_CPU_GROUPS, reason="torch 2.15 on splits CPU groups (test_split_group_as_on_gloo)")
def test_split_group_refused_as_on_gloo():
    """Before torch 2.15 ``dist.split_group`` splits only a default group bound to a device (``bound_device_id``,
    which ``init_process_group(device_id=...)`` sets for an accelerator only) and, without an accelerator, refuses
    before it asks any CPU backend (distributed_c10d.py, torch 2.13.0 lines 5570 and 5596-5607, 2.14.1 lines 6607
    and 6633-6644): a CPU backend cannot be split by torch, so mpcomm's refusal must be gloo's."""
    on_gloo, on_mpcomm = on_backend("gloo", _split_group_error), on_backend("mpcomm", _split_group_error)
    assert on_mpcomm == on_gloo and "not safe to split" in on_gloo


def _split_in_two() -> dict:
    """``dist.split_group`` into the even and the odd ranks, each list in descending order (a child's rank is the
    position in its list), with a timeout of its own; then what this rank's child group does."""
    halves = [list(range(first, SIZE, 2))[::-1] for first in (0, 1) if first < SIZE]
    child = dist.split_group(split_ranks=halves, timeout=timedelta(seconds=37))
    summed, sent = torch.tensor([float(RANK), 1.0]), torch.tensor([float(RANK)])
    dist.all_reduce(summed, group=child)
    dist.broadcast(sent, group_src=0, group=child)
    gathered = [torch.zeros(1) for _ in range(dist.get_world_size(child))]
    dist.all_gather(gathered, torch.tensor([float(RANK)]), group=child)
    return {"rank": dist.get_rank(child), "size": dist.get_world_size(child),
            "global ranks": dist.get_process_group_ranks(child), "sum": summed.tolist(),
            "from child rank 0": sent.item(), "gathered": [t.item() for t in gathered]}


def _split_off_rank_0() -> object:
    """``dist.split_group`` of rank 0 alone: every other rank gets no group."""
    child = dist.split_group(split_ranks=[[0]])
    if child is dist.GroupMember.NON_GROUP_MEMBER:
        return "not a member"
    summed = torch.tensor([5.0])
    dist.all_reduce(summed, group=child)
    return (dist.get_world_size(child), summed.item())


@no_accelerator
@pytest.mark.skipif(not SPLITS_CPU_GROUPS, reason="torch splits CPU groups from 2.15 (test_split_group_refused_...)")
def test_split_group_as_on_gloo():
    """torch 2.15's ``dist.split_group`` of a CPU group, against gloo's and against the ranks' arithmetic: the
    child's ranks in the order given, collectives over the child alone, non-members left out."""
    mine = list(range(RANK % 2, SIZE, 2))[::-1]
    expected = {"rank": mine.index(RANK), "size": len(mine), "global ranks": mine,
                "sum": [float(sum(mine)), float(len(mine))], "from child rank 0": float(mine[0]),
                "gathered": [float(r) for r in mine]}
    assert on_backend("mpcomm", _split_in_two) == on_backend("gloo", _split_in_two) == expected
    alone = (1, 5.0) if RANK == 0 else "not a member"
    assert on_backend("mpcomm", _split_off_rank_0) == on_backend("gloo", _split_off_rank_0) == alone


def _split_timeout() -> float:
    child = dist.split_group(split_ranks=[list(range(SIZE))], timeout=timedelta(seconds=37))
    return backend_of(child).comm.timeout


@no_accelerator
@pytest.mark.skipif(not SPLITS_CPU_GROUPS, reason="torch splits CPU groups from 2.15")
def test_split_group_child_takes_its_timeout():
    assert on_backend("mpcomm", _split_timeout) == 37.0


def _overlapping_split() -> str:
    try:
        dist.split_group(split_ranks=[[0, 1], [1, 2]])  # rank 1 takes the first, rank 2 joins [1, 2] alone
    except ValueError as exc:
        return str(exc)
    return "split"


@no_accelerator
@pytest.mark.skipif(not SPLITS_CPU_GROUPS or SIZE != 3, reason="torch splits CPU groups from 2.15; 3 ranks")
def test_split_group_with_overlapping_ranks_is_a_value_error_where_they_differ():
    """torch checks each split's ranks but not that the splits are disjoint; a rank whose child group is not the
    ranks it was given gets one clear error (no hang), the others their group."""
    said = on_backend("mpcomm", _overlapping_split)
    if RANK == 2:
        assert "split_group: rank 2 was given ranks [1, 2]" in said and "must not overlap" in said, said
    else:
        assert said == "split"


# ============================================================================ point to point
@multi
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_batch_isend_irecv_ring(pg, n):
    """Each rank sends a float and an int tensor to the next rank and receives the previous rank's, in one batch."""
    after, before = (RANK + 1) % SIZE, (RANK - 1) % SIZE

    def values(rank):
        return torch.arange(n, dtype=torch.float64) * 0.5 + rank, torch.arange(n, dtype=torch.int32) - 3 * rank

    floats, ints = torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.int32)
    ops = [dist.P2POp(dist.isend, values(RANK)[0], after), dist.P2POp(dist.irecv, floats, before),
           dist.P2POp(dist.isend, values(RANK)[1], after), dist.P2POp(dist.irecv, ints, before)]

    def run():
        works = dist.batch_isend_irecv(ops)
        assert len(works) == 4
        for work in works:
            work.wait()
        assert all(work.is_completed() for work in works)

    in_step(run)
    assert torch.equal(floats, values(before)[0]) and torch.equal(ints, values(before)[1])


@multi
def test_send_and_recv_object_list(pg):
    """Rank 0 sends each other rank a list of objects (a dict, a string, a tensor, None) made for it."""
    def made_for(rank):
        return [{"to": rank, "squares": [i * i for i in range(rank + 3)]}, "x" * (rank * 1000), torch.ones(rank), None]

    def run():
        if RANK == 0:
            for peer in range(1, SIZE):
                dist.send_object_list(made_for(peer), dst=peer)
            return None
        got = [object()] * 4
        dist.recv_object_list(got, src=0)
        return got

    got = in_step(run)
    if RANK:
        expected = made_for(RANK)
        assert got[:2] == expected[:2] and torch.equal(got[2], expected[2]) and got[3] is None


@multi
def test_recv_from_any_source_reports_the_sender(pg):
    """dist.recv without src (recv_anysource): the tensor of whichever rank sent, and that rank returned."""
    def run():
        if RANK == 0:
            senders = []
            for _ in range(SIZE - 1):
                t = torch.empty(3)
                sender = dist.recv(t)
                assert t.tolist() == [float(sender)] * 3
                senders.append(sender)
            return sorted(senders)
        dist.send(torch.full((3,), float(RANK)), dst=0)
        return None

    assert in_step(run) in (None, list(range(1, SIZE)))


# ============================================================================ monitored barrier
def _monitored_barrier(group, timeout, wait_all_ranks=False):
    if MONITORED_BARRIER_BY_NAME:
        return mpt.monitored_barrier(group, timeout, wait_all_ranks=wait_all_ranks)
    return dist.monitored_barrier(group, timeout, wait_all_ranks=wait_all_ranks)


def test_monitored_barrier_where_torch_allows_it(pg):
    """torch 2.14 on: dist.monitored_barrier itself runs on mpcomm; torch 2.13 refuses it by name (the helper runs
    the same barrier there)."""
    if MONITORED_BARRIER_BY_NAME:
        with pytest.raises(ValueError, match="only implemented for GLOO"):
            dist.monitored_barrier(timeout=timedelta(seconds=30))
    in_step(lambda: _monitored_barrier(None, timedelta(seconds=30), wait_all_ranks=True))


@multi
def test_monitored_barrier_names_the_rank_that_never_arrives(pg):
    """The last rank never calls it: within the 1 s timeout (plus slack) rank 0 raises naming that rank, and the
    ranks that did arrive raise naming rank 0 (gloo's messages); every rank says it within bounded time."""
    group = dist.new_group(timeout=timedelta(seconds=1))
    missing = SIZE - 1

    def run():
        if RANK == missing:
            return None
        start = time.monotonic()
        with pytest.raises(RuntimeError) as caught:
            _monitored_barrier(group, timedelta(seconds=1))
        return str(caught.value), time.monotonic() - start

    outcome = in_step(run)
    if RANK == 0:
        message, elapsed = outcome
        assert f"Rank {missing} failed to pass monitoredBarrier in 1000 ms" in message
        assert 0.9 < elapsed < 10
    elif RANK != missing:
        message, elapsed = outcome
        assert "received errors while waiting for send/recv from rank 0" in message and elapsed < 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failed group is left allocated (see test_backend_semantics)
        in_step(lambda: dist.destroy_process_group(group))


# ============================================================================ DCP async save
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(7, 13), torch.nn.Linear(13, 5)  # primes: uneven shards at any N

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _async_save_then_load_replicated(directory: str) -> tuple[dict, dict]:
    """A model fully_shard-ed over every rank, trained a step, saved with dcp.async_save; then loaded into a plain
    (unsharded) model on every rank. Returns (the sharded model's full parameters, what was loaded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = _Model()
    fully_shard(model, mesh=init_device_mesh("cpu", (SIZE,)))
    torch.nn.functional.mse_loss(model(torch.randn(4, 7)), torch.zeros(4, 5)).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    future = dcp.async_save({"model": model.state_dict()}, checkpoint_id=directory)
    future.result()
    plain = _Model()
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    plain.load_state_dict(state["model"])
    return full, {name: p.detach().clone() for name, p in plain.named_parameters()}


@multi
def test_dcp_async_save_then_load_at_another_layout():
    directory = WORLD.bcast(tempfile.mkdtemp(prefix="mpcomm-dcp-") if RANK == 0 else None, root=0)
    try:
        full, loaded = on_backend("mpcomm", lambda: _async_save_then_load_replicated(directory), 120)
    finally:
        run_gathered(lambda: shutil.rmtree(directory) if RANK == 0 else None)
    assert full.keys() == loaded.keys()
    for name in full:
        assert torch.equal(loaded[name], full[name]), name
    assert any(not torch.equal(loaded[name], torch.zeros_like(loaded[name])) for name in loaded)
