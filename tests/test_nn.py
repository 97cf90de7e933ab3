"""Single-process tests of mpcomm.nn: gradients, accumulation, hooks, optimizers, state, determinism."""
from __future__ import annotations

import math

import numpy as np
import pytest

import mpcomm.nn as nn


def rng(seed=0):
    return np.random.default_rng(seed)


def fd_check(fn, arrays, grads, eps=1e-6, rtol=1e-6, atol=1e-8):
    """Central-difference check: fn() -> scalar loss; arrays perturbed in place; grads analytic."""
    for a, g in zip(arrays, grads):
        num = np.zeros_like(a)
        it = np.nditer(a, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            old = a[i]
            a[i] = old + eps
            lp = fn()
            a[i] = old - eps
            lm = fn()
            a[i] = old
            num[i] = (lp - lm) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=rtol, atol=atol)


def check_module(m, x, seed=1):
    """Gradient-check input and every parameter of ``m`` against loss = sum(w * m(x))."""
    y, _ = m.forward(x)
    w = rng(seed).standard_normal(y.shape)
    loss = lambda: float((m.forward(x)[0] * w).sum())
    m.zero_grad()
    y, ctx = m.forward(x)
    gx = m.backward(w.copy(), ctx)
    params = m.parameters()
    fd_check(loss, [x] + [p.data for p in params], [gx] + [p.grad for p in params])


LAYERS = {
    "linear": lambda: (nn.Linear(5, 3, seed=3), rng().standard_normal((2, 4, 5))),
    "linear_nobias": lambda: (nn.Linear(5, 3, bias=False, seed=3), rng().standard_normal((4, 5))),
    "layernorm": lambda: (nn.LayerNorm(6), rng().standard_normal((3, 6))),
    "gelu": lambda: (nn.GELU(), rng().standard_normal((3, 5))),
    "relu": lambda: (nn.ReLU(), rng().standard_normal((3, 5)) + 0.05),
    "identity": lambda: (nn.Identity(), rng().standard_normal((3, 5))),
    "residual": lambda: (nn.Residual(nn.Linear(4, 4, seed=1)), rng().standard_normal((3, 4))),
    "block": lambda: (nn.TransformerMLPBlock(4, 7, seed=2), rng().standard_normal((2, 3, 4))),
    "stack": lambda: (nn.transformer_mlp_stack(2, 4, 6, seed=1), rng().standard_normal((3, 4))),
    "mlp": lambda: (nn.mlp([4, 6, 3], activation="relu", seed=2), rng().standard_normal((5, 4))),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_gradients_finite_difference(name):
    m, x = LAYERS[name]()
    if name == "layernorm":  # non-trivial affine params
        m.weight.data[:] = rng(5).standard_normal(6)
        m.bias.data[:] = rng(6).standard_normal(6)
    check_module(m, x)


def test_dropout_gradient_uses_ctx_mask():
    d = nn.Dropout(0.4, seed=7)
    x = rng().standard_normal((6, 5))
    y, mask = d.forward(x)
    np.testing.assert_array_equal(d.backward(np.ones_like(x), mask), mask)
    np.testing.assert_array_equal(y, x * mask)
    assert set(np.unique(mask)) <= {0.0, 1 / 0.6}
    d.eval()
    assert d.forward(x)[0] is x
    assert nn.Dropout(0.0).forward(x)[0] is x


def test_embedding_gradient():
    e = nn.Embedding(5, 3, seed=1)
    idx = np.array([[0, 2, 2], [4, 0, 1]])
    y, ctx = e.forward(idx)
    np.testing.assert_array_equal(y, e.weight.data[idx])
    w = rng(2).standard_normal(y.shape)
    assert e.backward(w, ctx) is None
    fd_check(lambda: float((e.forward(idx)[0] * w).sum()), [e.weight.data], [e.weight.grad])


def test_losses_finite_difference():
    r = rng(3)
    pred, target = r.standard_normal((4, 3)), r.standard_normal((4, 3))
    loss, g = nn.mse_loss(pred, target)
    assert math.isclose(loss, float(((pred - target) ** 2).mean()), rel_tol=1e-14)
    fd_check(lambda: nn.mse_loss(pred, target)[0], [pred], [g])

    logits, labels = r.standard_normal((5, 4)) * 3, np.array([0, 3, 1, 1, 2])
    loss, g = nn.cross_entropy(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert math.isclose(loss, float(-np.log(p[np.arange(5), labels]).mean()), rel_tol=1e-12)
    fd_check(lambda: nn.cross_entropy(logits, labels)[0], [logits], [g])
    big_loss, big_g = nn.cross_entropy(np.array([[1000.0, 0.0], [0.0, -1000.0]]), np.array([1, 1]))
    assert np.isfinite(big_loss) and np.all(np.isfinite(big_g))


def _grads(m):
    return {n: p.grad.copy() for n, p in m.named_parameters()}


def test_grad_accumulation_and_zero_grad():
    m = nn.transformer_mlp_stack(2, 4, 8, seed=0)
    x = rng().standard_normal((3, 4))
    y, ctx = m.forward(x)
    m.backward(np.ones_like(y), ctx)
    once = _grads(m)
    y, ctx = m.forward(x)
    m.backward(np.ones_like(y), ctx)
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, 2 * once[n], rtol=1e-14)
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    m.backward(np.ones_like(y), ctx)
    m.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())


def test_interleaved_microbatches_match_sequential():
    r = rng(4)
    xs = [r.standard_normal((2, 4)) for _ in range(2)]
    m = nn.Sequential(nn.transformer_mlp_stack(2, 4, 6, seed=1), nn.Linear(4, 2, seed=9))
    for x in xs:
        y, c = m.forward(x)
        m.backward(np.cos(y), c)
    seq = _grads(m)
    m.zero_grad()
    outs = [m.forward(x) for x in xs]
    gxs = [m.backward(np.cos(y), c) for y, c in reversed(outs)]
    assert len(gxs) == 2
    for n, p in m.named_parameters():
        np.testing.assert_allclose(p.grad, seq[n], rtol=1e-12)


def test_grad_hooks_fire_once_in_reverse_order_and_remove():
    m = nn.transformer_mlp_stack(2, 4, 6, seed=1)
    fired = []
    handles = [p.register_grad_hook(lambda p: fired.append(p.name)) for p in m.parameters()]
    y, ctx = m.forward(rng().standard_normal((2, 4)))
    m.backward(np.ones_like(y), ctx)
    names = [n for n, _ in m.named_parameters()]
    assert fired == names[::-1]
    for h in handles:
        h.remove()
    fired.clear()
    m.backward(np.ones_like(y), ctx)
    assert fired == []


class _LoggedWeight(np.ndarray):
    """A weight array that logs ``grad @ weight`` (a Linear's input gradient) into its ``log``, noting whether
    the weight's gradient existed by then."""

    def __rmatmul__(self, other):
        self.log.append(f"input grad (weight grad {'set' if self.param.grad is not None else 'unset'})")
        return np.asarray(other) @ np.asarray(self)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("hooked", [True, False])
def test_linear_finishes_the_awaited_gradient_first(hooked, with_bias):
    # hooked (DDP launches a bucket from the hooks): the parameters' first, so the first layer's all-reduce, which
    # no later backward can hide, overlaps the matmul of its input gradient; otherwise the input's first (the next
    # backward or pipeline stage waits for it)
    lin = nn.Linear(3, 2, bias=with_bias, seed=0)
    log: list = []
    if hooked:
        for p in lin.parameters():
            p.register_grad_hook(lambda p: log.append(p.name))
    assert lin.weight.awaited == hooked
    y, ctx = lin.forward(rng().standard_normal((4, 3)))
    weight = lin.weight.data.view(_LoggedWeight)  # from here on
    weight.log, weight.param = log, lin.weight
    lin.weight.data = weight
    gx = lin.backward(np.ones_like(y), ctx)
    if hooked:
        assert log == (["bias", "weight"] if with_bias else ["weight"]) + ["input grad (weight grad set)"]
    else:
        assert log == ["input grad (weight grad unset)"]
    np.testing.assert_allclose(gx, np.ones_like(y) @ np.asarray(lin.weight.data))


def test_module_hooks_fire_at_every_level_and_remove():
    m = nn.mlp([3, 4, 2], seed=0)
    events = []
    handles = []
    for name, mod in m.named_modules():
        for kind in ("forward_pre", "forward_post", "backward_pre", "backward_post"):
            reg = getattr(mod, f"register_{kind}_hook")
            handles.append(reg(lambda mod, kind=kind, name=name: events.append((kind, name or "root"))))
    y, ctx = m.forward(rng().standard_normal((2, 3)))
    m.backward(np.ones_like(y), ctx)
    assert events[:2] == [("forward_pre", "root"), ("forward_pre", "0")]
    assert events[5:8] == [("forward_pre", "2"), ("forward_post", "2"), ("forward_post", "root")]
    assert events[8:10] == [("backward_pre", "root"), ("backward_pre", "2")]
    assert events[-2:] == [("backward_post", "0"), ("backward_post", "root")]
    assert len(events) == 4 * 4
    for h in handles:
        h.remove()
    events.clear()
    m.backward(np.ones_like(y), ctx)
    assert events == []


def test_parameter_data_read_at_call_time():
    lin = nn.Linear(3, 2, seed=0)
    x = rng().standard_normal((1, 3))
    flat = np.zeros(lin.num_parameters())
    flat[:6] = lin.weight.data.ravel()
    flat[6:] = lin.bias.data
    lin.weight.data, lin.bias.data = flat[:6].reshape(2, 3), flat[6:]  # FSDP-style views
    flat *= 2
    np.testing.assert_allclose(lin(x), 2 * (x @ (flat[:6].reshape(2, 3) / 2).T + flat[6:] / 2))
    lin.weight.grad = np.zeros((2, 3))
    nn.SGD(lin.parameters(), lr=0.1).step()
    assert lin.weight.data.base is flat  # updated in place, still a view


def test_sequential_slicing_shares_modules_and_names():
    m = nn.transformer_mlp_stack(4, 4, 6, seed=0)
    assert len(m) == 4 and len(m[1:3]) == 2
    stage = m[2:]
    assert stage[0] is m[2] and stage.parameters()[0] is m[2].parameters()[0]
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in m.named_parameters()][12:]
    assert m[2].fc1.weight.name == "2.fc1.weight"
    x = rng().standard_normal((2, 4))
    h, c0 = m[:2].forward(x)
    y, c1 = m[2:].forward(h)
    np.testing.assert_allclose(y, m(x), rtol=0, atol=0)


def test_state_dict_round_trip_and_errors():
    a, b = nn.transformer_mlp_stack(2, 4, 6, seed=0), nn.transformer_mlp_stack(2, 4, 6, seed=5)
    sd = a.state_dict()
    assert list(sd) == [n for n, _ in a.named_parameters()]
    sd["0.fc1.weight"] += 0  # a copy: mutating must not touch a
    b.load_state_dict(sd)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data)
    sd[next(iter(sd))][...] = 123.0
    assert not np.any(a.parameters()[0].data == 123.0)
    bad = dict(sd)
    bad["0.fc1.weight"] = np.zeros((3, 3))
    with pytest.raises(ValueError, match=r"0\.fc1\.weight.*\(3, 3\).*\(6, 4\)"):
        b.load_state_dict(bad)
    with pytest.raises(KeyError, match="missing"):
        b.load_state_dict({k: v for k, v in sd.items() if k != "1.ln.bias"})
    assert a.num_parameters() == 2 * (4 + 4 + 4 * 6 + 6 + 6 * 4 + 4)


def test_backend_and_to():
    assert nn.array_module(np.zeros(2)) is np
    m = nn.mlp([2, 3], seed=0)
    w = m[0].weight.data
    assert m.to(np) is m and m[0].weight.data is not w
    np.testing.assert_array_equal(m[0].weight.data, w)


def test_determinism():
    a, b = nn.transformer_mlp_stack(3, 4, 6, seed=11), nn.transformer_mlp_stack(3, 4, 6, seed=11)
    for p, q in zip(a.parameters(), b.parameters()):
        assert p.data.tobytes() == q.data.tobytes()
    c = nn.transformer_mlp_stack(3, 4, 6, seed=12)
    assert a.parameters()[2].data.tobytes() != c.parameters()[2].data.tobytes()
    ws = [p.data for n, p in a.named_parameters() if n.endswith("fc1.weight")]
    assert not np.array_equal(ws[0], ws[1])
    x = np.ones((4, 5))
    d1, d2 = nn.Dropout(0.5, seed=3), nn.Dropout(0.5, seed=3)
    m1, m2 = d1.forward(x)[1], d2.forward(x)[1]
    np.testing.assert_array_equal(m1, m2)
    assert not np.array_equal(d1.forward(x)[1], m1)  # next draw differs
    assert nn.Linear(3, 2, seed=0, dtype=np.float32).weight.data.dtype == np.float32


# ---- optimizers -----------------------------------------------------------------------------
def ref_sgd(p, grads, lr, momentum, wd, nesterov, dampening=0.0):
    p, buf = p.copy(), None
    for g in grads:
        g = g + wd * p
        if momentum:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p


def ref_adam(p, grads, lr, b1, b2, eps, wd):
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
    return p


def _run_opt(make, p0, grads):
    p = nn.Parameter(p0.copy())
    opt = make([p])
    for g in grads:
        p.grad = g.copy()
        opt.step()
        opt.zero_grad()
    return p.data, opt


P0 = rng(8).standard_normal((3, 4))
GRADS = [rng(9 + i).standard_normal((3, 4)) for i in range(5)]


@pytest.mark.parametrize("momentum,wd,nesterov", [(0.0, 0.0, False), (0.9, 0.01, False), (0.9, 0.1, True)])
def test_sgd_matches_reference(momentum, wd, nesterov):
    got, _ = _run_opt(lambda ps: nn.SGD(ps, lr=0.1, momentum=momentum, weight_decay=wd, nesterov=nesterov), P0, GRADS)
    np.testing.assert_allclose(got, ref_sgd(P0, GRADS, 0.1, momentum, wd, nesterov), rtol=1e-12)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam_matches_reference(wd):
    got, opt = _run_opt(lambda ps: nn.Adam(ps, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=wd), P0, GRADS)
    np.testing.assert_allclose(got, ref_adam(P0, GRADS, 1e-2, 0.8, 0.99, 1e-6, wd), rtol=1e-12)
    assert opt.state[0]["step"] == len(GRADS)


@pytest.mark.torch
def test_optimizers_match_torch():
    torch = pytest.importorskip("torch")
    for make, tmake in [
        (lambda ps: nn.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
         lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)),
        (lambda ps: nn.Adam(ps, lr=1e-2, weight_decay=0.05), lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05)),
    ]:
        got, _ = _run_opt(make, P0, GRADS)
        tp = torch.nn.Parameter(torch.tensor(P0))
        topt = tmake([tp])
        for g in GRADS:
            tp.grad = torch.tensor(g)
            topt.step()
        np.testing.assert_allclose(got, tp.detach().numpy(), rtol=1e-10)


def test_optimizer_skips_none_grads_and_state_round_trip():
    p, q = nn.Parameter(P0.copy()), nn.Parameter(P0.copy())
    opt = nn.Adam([p, q], lr=1e-2)
    p.grad = GRADS[0].copy()
    opt.step()
    np.testing.assert_array_equal(q.data, P0)
    assert 1 not in opt.state
    sd = opt.state_dict()
    # resume: continuing from the state dict equals continuing the original
    p2 = nn.Parameter(p.data.copy())
    opt2 = nn.Adam([p2, nn.Parameter(P0.copy())], lr=5.0)
    opt2.load_state_dict(sd)
    assert opt2.lr == 1e-2
    for o, par in ((opt, p), (opt2, p2)):
        par.grad = GRADS[1].copy()
        o.step()
    np.testing.assert_array_equal(p.data, p2.data)
    sd["state"][0]["exp_avg"] = np.zeros(2)
    with pytest.raises(ValueError, match="exp_avg"):
        opt2.load_state_dict(sd)


def test_sgd_state_round_trip():
    p = nn.Parameter(P0.copy())
    opt = nn.SGD([p], lr=0.1, momentum=0.9)
    p.grad = GRADS[0].copy()
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["momentum_buffer"] += 0
    p2 = nn.Parameter(p.data.copy())
    opt2 = nn.SGD([p2], lr=0.1, momentum=0.9)
    opt2.load_state_dict(sd)
    for o, par in ((opt, p), (opt2, p2)):
        par.grad = GRADS[1].copy()
        o.step()
    np.testing.assert_array_equal(p.data, p2.data)


def test_clip_grad_norm():
    ps = [nn.Parameter(np.zeros(3)), nn.Parameter(np.zeros(4)), nn.Parameter(np.zeros(2))]
    ps[0].grad, ps[1].grad = np.array([3.0, 0, 0]), np.array([0, 4.0, 0, 0])
    total = nn.clip_grad_norm_(ps, 1.0)
    assert math.isclose(total, 5.0)
    assert math.isclose(float(np.sqrt(sum((p.grad ** 2).sum() for p in ps[:2]))), 1.0, rel_tol=1e-5)
    assert math.isclose(nn.clip_grad_norm_(ps, 10.0, reduce_sq=lambda s: 4 * s), 2.0, rel_tol=1e-5)


def test_training_loop_decreases_loss():
    m = nn.mlp([4, 16, 1], seed=0)
    r = rng(1)
    x = r.standard_normal((32, 4))
    t = np.sin(x.sum(-1, keepdims=True))
    opt = nn.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        y, ctx = m.forward(x)
        loss, g = nn.mse_loss(y, t)
        losses.append(loss)
        opt.zero_grad()
        m.backward(g, ctx)
        opt.step()
    assert losses[-1] < 0.5 * losses[0]
