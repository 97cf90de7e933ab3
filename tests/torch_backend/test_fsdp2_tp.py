"""torch FSDP2 (``fully_shard``) and tensor parallelism x data parallelism on a 2-D ``init_device_mesh`` train on
mpcomm to the same parameters as the same program on gloo, in the same job (rtol 1e-5).

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_fsdp2_tp.py``; FSDP2 at any
N >= 2, the 2-D mesh (2 x 2) at N = 4 only (``make test-torch`` runs it there).
"""
from __future__ import annotations

import pytest
from conftest import WORLD

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch_backend.groups import on_backend  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = [pytest.mark.torch, pytest.mark.mpi,
              pytest.mark.skipif(SIZE < 2, reason="needs several ranks"),
              pytest.mark.skipif(not dist.is_gloo_available(), reason="this PyTorch has no gloo")]
STEPS, WIDTH, SEED = 4, 16, 1234


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.w2 = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.w3 = torch.nn.Linear(WIDTH, 4 * WIDTH)
        self.w4 = torch.nn.Linear(4 * WIDTH, 1)

    def forward(self, x):
        return self.w4(torch.relu(self.w3(self.w2(torch.relu(self.w1(x))))))


def batch(shard: int):
    g = torch.Generator().manual_seed(SEED + 17 * shard)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, 1, generator=g)


def train(model, shard: int) -> dict:
    """A few Adam steps on this data shard; the full (unsharded) parameters after them."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = batch(shard)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def fsdp2_program():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (SIZE,))
    torch.manual_seed(SEED)
    model = MLP()
    for layer in (model.w1, model.w2, model.w3, model.w4):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return train(model, shard=RANK)


def tp_dp_program():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(SEED)
    model = MLP()
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel(),
                                           "w3": ColwiseParallel(), "w4": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return train(model, shard=mesh["dp"].get_local_rank())


def single_process_reference(shards: int) -> dict:
    """One process on the whole batch (every shard's mean loss, averaged): what data parallelism computes."""
    torch.manual_seed(SEED)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = [batch(s) for s in range(shards)]
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in data) / shards
        loss.backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_params_close(got: dict, expected: dict, rtol: float, what: str) -> None:
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def test_fsdp2_matches_gloo():
    on_gloo, on_mpcomm = on_backend("gloo", fsdp2_program, 120), on_backend("mpcomm", fsdp2_program, 120)
    assert_params_close(on_mpcomm, on_gloo, 1e-5, "FSDP2 mpcomm vs gloo")
    assert_params_close(on_mpcomm, single_process_reference(SIZE), 1e-4, "FSDP2 mpcomm vs one process")


@pytest.mark.skipif(SIZE != 4, reason="the 2 x 2 mesh needs exactly 4 ranks")
def test_tensor_parallel_by_data_parallel_matches_gloo():
    on_gloo, on_mpcomm = on_backend("gloo", tp_dp_program, 120), on_backend("mpcomm", tp_dp_program, 120)
    assert_params_close(on_mpcomm, on_gloo, 1e-5, "TP x DP mpcomm vs gloo")
    assert_params_close(on_mpcomm, single_process_reference(2), 1e-4, "TP x DP mpcomm vs one process")
