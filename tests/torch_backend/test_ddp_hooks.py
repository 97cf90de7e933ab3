"""torch's own DDP communication hooks (``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``) under
torch DDP on the mpcomm backend, against the same hook's math done on one process over every rank's local
gradients (gathered through MPI), and against the same program on gloo in the same job.

The data are small integers and the weights multiples of 1/8, so every rank's contribution to a 16-bit sum is
exact in float32 in any order: the compress hooks must then give the one-process math bit for bit. PowerSGD at a
rank no smaller than any matrix (and ``min_compression_rate=0``, so every matrix is compressed) reproduces the plain
average up to the orthogonalization's rounding, with error feedback and warm start on; at rank 1 it is compared
with gloo (same seed, so the same random starts).

torch's CPU builds refuse ``bf16_compress_hook`` by name in ``DistributedDataParallel._check_comm_hook`` (it asks
for CUDA and NCCL >= 2.10, whatever the backend); there the tests check that refusal and register the same
function under another name.

Run: ``timeout 600 mpiexec -n N python -m pytest -q --with-mpi -m mpi tests/torch_backend/test_ddp_hooks.py``.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import pytest
from conftest import WORLD

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from torch_backend.groups import on_backend  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = [pytest.mark.torch, pytest.mark.mpi,
              pytest.mark.skipif(not dist.is_gloo_available(), reason="this PyTorch has no gloo")]
STEPS, BATCH, SEED = 4, 16, 29
LR = 2.0 ** -6
# DDP refuses bf16_compress_hook on a torch built without CUDA and NCCL (any backend, any machine)
BF16_HOOK_REFUSED = torch.version.cuda is None and torch.version.hip is None

Hook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[torch.Tensor]"]


def bf16_compress_hook_unchecked(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` itself, under a name DDP's CPU-build check does not refuse."""
    return default_hooks.bf16_compress_hook(state, bucket)


# DDP compares the annotations with the classes themselves (this module's are strings)
bf16_compress_hook_unchecked.__annotations__ = dict(default_hooks.bf16_compress_hook.__annotations__)

COMPRESS_HOOKS: dict[str, tuple[torch.dtype, Hook]] = {
    "fp16": (torch.float16, default_hooks.fp16_compress_hook),
    "bf16": (torch.bfloat16, bf16_compress_hook_unchecked if BF16_HOOK_REFUSED else default_hooks.bf16_compress_hook),
}


def make_model() -> torch.nn.Module:
    """The same small MLP on every rank: weights multiples of 1/8 in [-1, 1]; parameters of 1 and 2 dims."""
    g = torch.Generator().manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 6))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=g).float() / 8)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    return (torch.randint(-3, 4, (BATCH, 12), generator=g).float(),
            torch.randint(-3, 4, (BATCH, 6), generator=g).float())


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return ((model(x) - y) ** 2).sum() / 64  # a power of two: the gradients stay dyadic


def train(hook: Hook | None, state: Any = None, bucket_cap_mb: float = 1e-6
          ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """STEPS SGD steps of DDP (by default one bucket per parameter) on the default group with ``hook`` registered;
    per step, (the gradients DDP left, this rank's local gradients of the same parameters and batch)."""
    model = make_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        optimizer.zero_grad()
        alone = copy.deepcopy(model)
        loss_of(alone, dist.get_rank(), step).backward()
        loss_of(ddp, dist.get_rank(), step).backward()
        steps.append(([p.grad.clone() for p in model.parameters()], [p.grad.clone() for p in alone.parameters()]))
        optimizer.step()
    return steps


def compress_math(dtype: torch.dtype, contributions: list[torch.Tensor]) -> torch.Tensor:
    """The compress hook on one process: each rank's gradient cast to ``dtype`` and divided by p there, summed in
    float32 and rounded once to ``dtype`` (the backend's 16-bit sum), cast back."""
    p = len(contributions)
    parts = [g.to(dtype).div_(p).float() for g in contributions]
    return functools.reduce(torch.add, parts).to(dtype).float()


def mismatches(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]], rtol: float = 0.0,
               atol: float = 0.0) -> list[str]:
    """Per step and parameter, where ``got`` differs from ``expected`` (bitwise for zero tolerances)."""
    out = []
    for step, (gs, es) in enumerate(zip(got, expected)):
        for i, (g, e) in enumerate(zip(gs, es)):
            same = torch.equal(g, e) if rtol == atol == 0 else torch.allclose(g, e, rtol=rtol, atol=atol)
            if not same:
                out.append(f"step {step} parameter {i}: max |diff| {(g - e).abs().max().item():.3g}")
    return out


def gathered_reference(steps, math: Callable[[list[torch.Tensor]], torch.Tensor]) -> list[list[torch.Tensor]]:
    """``math`` over every rank's local gradients, per step and parameter (one allgather)."""
    every = WORLD.allgather([local for _, local in steps])
    return [[math([every[r][step][i] for r in range(SIZE)]) for i in range(len(steps[step][1]))]
            for step in range(len(steps))]


def ddp_gradients(steps) -> list[list[torch.Tensor]]:
    return [grads for grads, _ in steps]


@pytest.mark.parametrize("name", list(COMPRESS_HOOKS))
def test_compress_hook_is_its_math_on_one_process_bitwise(name):
    dtype, hook = COMPRESS_HOOKS[name]
    steps = on_backend("mpcomm", lambda: train(hook))
    expected = gathered_reference(steps, functools.partial(compress_math, dtype))
    assert not mismatches(ddp_gradients(steps), expected), (RANK, mismatches(ddp_gradients(steps), expected))


@pytest.mark.parametrize("name", list(COMPRESS_HOOKS))
def test_compress_hook_equals_gloo(name):
    """gloo rounds its 16-bit sums its own way: equal within one rounding of the 16-bit type."""
    dtype, hook = COMPRESS_HOOKS[name]
    on_gloo = ddp_gradients(on_backend("gloo", lambda: train(hook)))
    on_mpcomm = ddp_gradients(on_backend("mpcomm", lambda: train(hook)))
    rtol = float(torch.finfo(dtype).eps)
    assert not mismatches(on_mpcomm, on_gloo, rtol=rtol, atol=1e-6), (RANK, mismatches(on_mpcomm, on_gloo, rtol, 1e-6))


@pytest.mark.skipif(not BF16_HOOK_REFUSED, reason="this torch build lets DDP register bf16_compress_hook")
@pytest.mark.parametrize("backend", ["mpcomm", "gloo"])
def test_cpu_build_refuses_bf16_hook_on_every_backend(backend):
    def register():
        ddp = DistributedDataParallel(make_model())
        with pytest.raises(TypeError, match="BF16 all reduce communication hook required CUDA"):
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)

    on_backend(backend, register)


def train_powersgd(rank: int) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """:func:`train` with ``powerSGD_hook`` (error feedback and warm start on, PowerSGD from the third step, every
    matrix compressed) and the whole model in one bucket: with several, the collectives PowerSGD issues from one
    bucket's future callbacks race with the next bucket's all-reduce issued by backward, so ranks may issue them
    in different orders (gloo then hangs; see docs/torch.md)."""
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                        min_compression_rate=0, use_error_feedback=True, warm_start=True,
                                        random_seed=SEED)
    return train(powerSGD_hook.powerSGD_hook, state, bucket_cap_mb=25)


def mean(gradients: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(torch.add, gradients) / len(gradients)


def test_powersgd_at_full_rank_is_the_average_of_the_gathered_gradients():
    """At a rank no smaller than any matrix, P Q^T projects onto the whole column space: the plain average
    (and the error-feedback terms sum to zero across ranks, so it stays the average)."""
    steps = on_backend("mpcomm", lambda: train_powersgd(24))
    problems = mismatches(ddp_gradients(steps), gathered_reference(steps, mean), rtol=1e-4, atol=1e-5)
    assert not problems, (RANK, problems)


def test_powersgd_at_rank_one_equals_gloo():
    """The same seed gives both backends the same random starts; the two warm-up steps are the plain average and
    the compressed ones are not."""
    on_gloo = ddp_gradients(on_backend("gloo", lambda: train_powersgd(1)))
    steps = on_backend("mpcomm", lambda: train_powersgd(1))
    on_mpcomm, average = ddp_gradients(steps), gathered_reference(steps, mean)
    problems = mismatches(on_mpcomm, on_gloo, rtol=1e-4, atol=1e-6)
    assert not problems, (RANK, problems)
    assert not mismatches(on_mpcomm[:2], average[:2], rtol=1e-5, atol=1e-6)
    assert mismatches(on_mpcomm[2:], average[2:], rtol=1e-3, atol=1e-4), "rank one compressed nothing"
