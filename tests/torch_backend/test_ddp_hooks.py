"""torch's own DDP communication hooks (``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook``) under
torch DDP on the mpcomm backend, against the same hook's math done on one process over every rank's local
gradients (gathered through MPI), and against the same program on gloo in the same job.

And mpcomm's own hook (``mpcomm.integrations.torch.hooks.wire_hook``, the group's compressed all-reduce) against
the all-reduce's documented result computed with the codec on one process, with and without error feedback.

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

import numpy as np  # noqa: E402
import mpcomm.integrations.torch.hooks as mpcomm_hooks  # noqa: E402
from mpcomm.compression import WIRES, codec  # noqa: E402
from mpcomm.integrations.torch.hooks import TORCH_REFUSES_BF16_HOOK, WireState, wire_hook  # noqa: E402
from test_wire import reference as wire_reference  # noqa: E402
from torch_backend.groups import on_backend  # noqa: E402

from mpi4py import MPI  # noqa: E402

RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
_HOST = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
RANKS_PER_HOST = None if _HOST.Get_size() == SIZE else _HOST.Get_size()  # (hosts spanned: the simulated cluster)
_HOST.Free()
pytestmark = [pytest.mark.torch, pytest.mark.mpi,
              pytest.mark.skipif(not dist.is_gloo_available(), reason="this PyTorch has no gloo")]
STEPS, BATCH, SEED = 4, 16, 29
LR = 2.0 ** -6
Hook = Callable[[Any, "dist.GradBucket"], "torch.futures.Future[torch.Tensor]"]
COMPRESS_HOOKS: dict[str, tuple[torch.dtype, Hook]] = {
    "fp16": (torch.float16, default_hooks.fp16_compress_hook),
    "bf16": (torch.bfloat16,
             mpcomm_hooks.bf16_compress_hook if TORCH_REFUSES_BF16_HOOK else default_hooks.bf16_compress_hook),
}


def make_model(widths: tuple[int, int, int] = (12, 24, 6), bias: bool = True) -> torch.nn.Module:
    """The same small MLP on every rank: weights multiples of 1/8 in [-1, 1]; parameters of 1 and 2 dims."""
    g = torch.Generator().manual_seed(SEED)
    inputs, hidden, outputs = widths
    model = torch.nn.Sequential(torch.nn.Linear(inputs, hidden, bias), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, outputs, bias))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=g).float() / 8)
    return model


def loss_of(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    """Squared error on this rank's batch of small integers."""
    layers = model.module if isinstance(model, DistributedDataParallel) else model
    first, last = layers[0], layers[-1]
    g = torch.Generator().manual_seed(SEED + 1000 * rank + step)
    x = torch.randint(-3, 4, (BATCH, first.in_features), generator=g).float()
    y = torch.randint(-3, 4, (BATCH, last.out_features), generator=g).float()
    return ((model(x) - y) ** 2).sum() / 64  # a power of two: the gradients stay dyadic


def train(hook: Hook | None, state: Any = None, bucket_cap_mb: float = 1e-6, model: torch.nn.Module | None = None
          ) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """STEPS SGD steps of DDP (one bucket per parameter after the first step; DDP's first bucket holds them all)
    on the default group with ``hook`` registered; per step, (the gradients DDP left, this rank's local gradients
    of the same parameters and batch)."""
    model = make_model() if model is None else model
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
               scaled: float = 0.0) -> list[str]:
    """Per step and parameter, where ``got`` differs from ``expected`` by more than ``rtol`` of the element plus
    ``scaled`` times the tensor's largest magnitude (bitwise for zero tolerances)."""
    out = []
    for step, (gs, es) in enumerate(zip(got, expected)):
        for i, (g, e) in enumerate(zip(gs, es)):
            if not (torch.isfinite(g).all() and torch.isfinite(e).all()):
                out.append(f"step {step} parameter {i}: not finite (got {g.isnan().sum().item()} NaN, the "
                           f"reference {e.isnan().sum().item()})")
                continue
            atol = scaled * e.abs().max().item() if e.numel() else 0.0
            same = torch.equal(g, e) if rtol == scaled == 0 else torch.allclose(g, e, rtol=rtol, atol=atol)
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
    """gloo rounds each partial sum to the 16-bit type (mpcomm once, from float32): equal within one rounding per
    rank of the tensor's largest magnitude."""
    dtype, hook = COMPRESS_HOOKS[name]
    on_gloo = ddp_gradients(on_backend("gloo", lambda: train(hook)))
    on_mpcomm = ddp_gradients(on_backend("mpcomm", lambda: train(hook)))
    problems = mismatches(on_mpcomm, on_gloo, scaled=SIZE * float(torch.finfo(dtype).eps))
    assert not problems, (RANK, problems)


@pytest.mark.skipif(not TORCH_REFUSES_BF16_HOOK, reason="this torch build lets DDP register bf16_compress_hook")
@pytest.mark.parametrize("backend", ["mpcomm", "gloo"])
def test_cpu_build_refuses_bf16_hook_on_every_backend(backend):
    def register():
        ddp = DistributedDataParallel(make_model())
        with pytest.raises(TypeError, match="BF16 all reduce communication hook required CUDA"):
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)

    on_backend(backend, register)


def train_powersgd(rank: int, bucket_cap_mb: float = 25) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """:func:`train` with ``powerSGD_hook`` (error feedback and warm start on, PowerSGD from the third step, every
    matrix compressed), by default with the whole model in one bucket (gloo can run no other: there the
    collectives one bucket's callbacks issue race with the next bucket's, and it hangs)."""
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                        min_compression_rate=0, use_error_feedback=True, warm_start=True,
                                        random_seed=SEED)
    return train(powerSGD_hook.powerSGD_hook, state, bucket_cap_mb=bucket_cap_mb)


def mean(gradients: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(torch.add, gradients) / len(gradients)


def test_powersgd_at_full_rank_is_the_average_of_the_gathered_gradients():
    """At a rank no smaller than any matrix, P Q^T projects onto the whole column space: the plain average
    (and the error-feedback terms sum to zero across ranks, so it stays the average)."""
    steps = on_backend("mpcomm", lambda: train_powersgd(24))
    problems = mismatches(ddp_gradients(steps), gathered_reference(steps, mean), rtol=1e-4, scaled=1e-5)
    assert not problems, (RANK, problems)


def test_powersgd_with_a_bucket_per_parameter_is_the_average_at_full_rank():
    """One bucket per parameter: each bucket's future callbacks issue PowerSGD's P and Q all-reduces (on the thread
    that completed the bucket's all-reduce) while backward issues the next buckets' all-reduces. The lane runs
    the callbacks' collectives before any issued by another thread, so every rank pairs them alike (before, the
    pairs mismatched: NaN or garbage with validation off)."""
    steps = on_backend("mpcomm", lambda: train_powersgd(24, bucket_cap_mb=1e-6))
    problems = mismatches(ddp_gradients(steps), gathered_reference(steps, mean), rtol=1e-4, scaled=1e-5)
    assert not problems, (RANK, problems)


def test_powersgd_at_rank_one_equals_gloo():
    """The same seed gives both backends the same random starts; the two warm-up steps are the plain average and
    the compressed ones are not."""
    on_gloo = ddp_gradients(on_backend("gloo", lambda: train_powersgd(1)))
    steps = on_backend("mpcomm", lambda: train_powersgd(1))
    on_mpcomm, average = ddp_gradients(steps), gathered_reference(steps, mean)
    problems = mismatches(on_mpcomm, on_gloo, rtol=1e-4, scaled=1e-5)
    assert not problems, (RANK, problems)
    assert not mismatches(on_mpcomm[:2], average[:2], rtol=1e-5, scaled=1e-6)
    assert mismatches(on_mpcomm[2:], average[2:], rtol=1e-3, scaled=1e-4), "rank one compressed nothing"


# ---------------------------------------------------------------------------------------------- mpcomm's wire hook
def wire_math(wire: str, contributions: list[torch.Tensor]) -> torch.Tensor:
    """The compressed average (mpcomm.algorithms.compressed, tests/test_wire.py's reference): each host's float32
    sum in rank order rounded by the codec, their sum divided by p, rounded again (on one host: the float32 sum of
    every rank, rounded, divided, rounded)."""
    return torch.from_numpy(wire_reference([g.numpy() for g in contributions], "avg", wire, RANKS_PER_HOST))


def fed_back(wire: str, per_step: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """A rank's gradients as error feedback sends them (one bucket per parameter): each step's gradient plus the
    rounding error ``x - roundtrip(x)`` the codec took from the previous step's."""
    c, kept, out = codec(wire), None, []
    for grads in per_step:
        sent = [g.numpy().reshape(-1) + (0 if kept is None else kept[i]) for i, g in enumerate(grads)]
        kept = [x - c.roundtrip(x) for x in sent]
        out.append([torch.from_numpy(x).reshape(g.shape) for x, g in zip(sent, grads)])
    return out


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error_feedback"])
@pytest.mark.parametrize("wire", WIRES)
def test_wire_hook_is_the_compressed_average_bitwise(wire, error_feedback):
    """Parameters of 512 and 256 elements: int8's 256-element blocks never straddle two, so each parameter
    rounds alike in DDP's first bucket (all of them) and in its own (after the rebuild)."""
    model = make_model((16, 32, 8), bias=False)
    steps = on_backend("mpcomm", lambda: train(wire_hook, WireState(wire, error_feedback=error_feedback), model=model))
    local = [grads for _, grads in steps]
    sent = fed_back(wire, local) if error_feedback else local
    every = WORLD.allgather(sent)
    expected = [[wire_math(wire, [every[r][step][i] for r in range(SIZE)]) for i in range(len(local[step]))]
                for step in range(STEPS)]
    problems = mismatches(ddp_gradients(steps), expected)
    assert not problems, (RANK, problems)


@pytest.mark.parametrize("wire", WIRES)
def test_wire_hook_where_it_pays_sends_float32_on_one_host(wire):
    """One host: the cost model never prices a wire as paying, so the hook is the plain average in float32, and
    error feedback keeps nothing. Bit for bit at the first step (the exact sums of small dyadic gradients); after
    an update the gradients carry more bits than float32's sums keep, so the library's order of addition (Open
    MPI's recursive doubling at p = 4) rounds: within a few float32 ulps, where a 16-bit wire would be 2^-8 off."""
    state = WireState(wire, error_feedback=True, where_it_pays=True)
    steps = on_backend("mpcomm", lambda: train(wire_hook, state, model=make_model((16, 32, 8), bias=False)))
    got, expected = ddp_gradients(steps), gathered_reference(steps, mean)
    problems = mismatches(got[:1], expected[:1]) + mismatches(got, expected, rtol=1e-6, scaled=1e-6)
    assert not problems, (RANK, problems)
    assert all(not e.any() for e in state.errors.values())


def test_wire_hook_refuses_a_group_on_another_backend_and_an_unknown_wire():
    with pytest.raises(ValueError, match="unknown wire 'fp8'"):
        WireState("fp8")

    def on_gloo():
        ddp = DistributedDataParallel(make_model())
        ddp.register_comm_hook(WireState("bf16"), wire_hook)
        with pytest.raises(Exception, match="the hook needs the mpcomm backend"):
            loss_of(ddp, dist.get_rank(), 0).backward()

    on_backend("gloo", on_gloo)
