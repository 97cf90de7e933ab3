"""torch.distributed.pipelining on a pp = 2 x dp = 2 DeviceMesh: every schedule (GPipe, 1F1B, 1F1B over
``fully_shard`` stages, Interleaved1F1B) trains on mpcomm to the same losses, gradients and parameters as the same
program on gloo, in the same job. The stages exchange activations and gradients through ``PipelineStage``'s
``batch_isend_irecv`` and shapes through ``send/recv_object_list`` on the pp group; the dp group all-reduces (or, for
``fully_shard``, reduce-scatters) the gradients.

Run: ``timeout 600 mpiexec -n 4 python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_pipelining.py``
(``make test-torch`` runs it there, on every torch it tests).
"""
from __future__ import annotations

import pytest
from conftest import WORLD

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch_backend.groups import on_backend  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = [pytest.mark.torch, pytest.mark.mpi,
              pytest.mark.skipif(SIZE != 4, reason="the pp = 2 x dp = 2 mesh needs exactly 4 ranks"),
              pytest.mark.skipif(not dist.is_gloo_available(), reason="this PyTorch has no gloo")]
WIDTH, BATCH, MICROBATCHES, STEPS, SEED = 12, 8, 4, 2, 2024
LAYERS = 4  # split into 2 stages of 2 layers, or (interleaved) 4 stages of 1


def layers() -> list:
    torch.manual_seed(SEED)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(LAYERS)]


def data(dp_rank: int, step: int):
    g = torch.Generator().manual_seed(SEED + 101 * dp_rank + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def pipeline_program(schedule_name: str, sharded: bool = False):
    """A few SGD steps of the schedule on this rank's stages; per stage, the losses (last stage), and the full
    gradients and parameters after the last step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    assert dist.get_backend(pp_group) == dist.get_backend()
    blocks = layers()
    interleaved = schedule_name == "Interleaved1F1B"
    stage_count = 4 if interleaved else 2
    per_stage = LAYERS // stage_count
    indices = [pp, pp + 2] if interleaved else [pp]
    modules = [torch.nn.Sequential(*blocks[i * per_stage:(i + 1) * per_stage]) for i in indices]
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for module in modules:
            fully_shard(module, mesh=mesh["dp"])
    stages = [PipelineStage(m, i, stage_count, torch.device("cpu"), group=pp_group) for m, i in zip(modules, indices)]
    loss_fn = torch.nn.functional.mse_loss
    if interleaved:
        schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=loss_fn)
    else:
        schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule_name](stages[0], MICROBATCHES,
                                                                                loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = data(dp, step)
        step_losses: list = []
        if pp == 0:
            schedule.step(x, target=y, losses=step_losses) if interleaved else schedule.step(x)
        else:
            schedule.step(target=y, losses=step_losses)
        losses.append([float(loss) for loss in step_losses])
        if not sharded:  # data parallelism by hand: the dp group averages the gradients
            for p in params:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp_group)
        optimizer.step()

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    return {"losses": losses,
            "grads": {f"{i}.{n}": full(p.grad) for m, i in zip(modules, indices) for n, p in m.named_parameters()},
            "params": {f"{i}.{n}": full(p) for m, i in zip(modules, indices) for n, p in m.named_parameters()}}


def assert_same_training(got: dict, expected: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-6, atol=1e-7,
                               msg=lambda m: f"{what} losses: {m}")
    for kind in ("grads", "params"):
        assert got[kind].keys() == expected[kind].keys()
        for name in got[kind]:
            torch.testing.assert_close(got[kind][name], expected[kind][name], rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"{what} {kind} {name}: {m}")


@pytest.mark.parametrize("schedule_name,sharded", [("GPipe", False), ("1F1B", False), ("1F1B", True),
                                                   ("Interleaved1F1B", False)])
def test_schedule_matches_gloo(schedule_name, sharded):
    program = lambda: pipeline_program(schedule_name, sharded)  # noqa: E731
    on_gloo, on_mpcomm = on_backend("gloo", program, 120), on_backend("mpcomm", program, 120)
    what = f"{schedule_name}{' over fully_shard stages' if sharded else ''} mpcomm vs gloo"
    assert_same_training(on_mpcomm, on_gloo, what)
    last_stage_here = RANK // 2 == 1  # the mesh is (pp, dp) row-major: pp rank 1 holds the last stage
    assert [len(step) for step in on_mpcomm["losses"]] == [MICROBATCHES if last_stage_here else 0] * STEPS
