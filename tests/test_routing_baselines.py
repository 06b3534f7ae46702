"""Dynamic routing and EM routing baselines: naive loop references, invariants, whole models,
losses.

The references below are written from the papers' equations with explicit loops over children
``i``, parents ``j``, pose entries ``h``, window positions and iterations (float64, tiny sizes).
"""

from __future__ import annotations

import math

import pytest
import torch

from capsctl.errors import ConfigError
from capsctl.models.capsnet import RoutingTrace
from capsctl.models.routing_baselines import (
    EM_COST_EPS,
    EM_EPS,
    EM_VAR_EPS,
    SQUASH_EPS,
    DynamicCapsNet,
    DynamicCapsules,
    EMCapsNet,
    EMCapsules,
    dynamic_config,
    em_config,
    margin_loss,
    spread_loss,
)
from capsctl.registry import get_config

# --------------------------------------------------------------------------------------------
# Naive references
# --------------------------------------------------------------------------------------------


def naive_squash(s: torch.Tensor) -> torch.Tensor:
    n2 = float((s * s).sum())
    return s * (n2 / (1.0 + n2)) / math.sqrt(n2 + SQUASH_EPS)


def naive_dynamic_site(uhat: list[list[torch.Tensor]], iterations: int):
    """Sabour et al. Procedure 1 for one site: ``uhat[i][j]`` is child i's vote for parent j.

    Returns per iteration ``c[i][j]`` and ``v[j]``.
    """
    n, m = len(uhat), len(uhat[0])
    blog = [[0.0] * m for _ in range(n)]
    cs, vs = [], []
    for t in range(iterations):
        c = [[0.0] * m for _ in range(n)]
        for i in range(n):
            z = sum(math.exp(blog[i][k]) for k in range(m))
            for j in range(m):
                c[i][j] = math.exp(blog[i][j]) / z
        v = []
        for j in range(m):
            s = torch.zeros_like(uhat[0][0])
            for i in range(n):
                s = s + c[i][j] * uhat[i][j]
            v.append(naive_squash(s))
        cs.append(c)
        vs.append(v)
        if t + 1 < iterations:
            for i in range(n):
                for j in range(m):
                    blog[i][j] += float((uhat[i][j] * v[j]).sum())
    return cs, vs


def naive_vote(pose: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """Child pose (d_in entries, ``rows`` rows) times ``w[x, c]`` -> vote (rows * c entries)."""
    x, c = w.shape
    p = pose.view(rows, x)
    out = torch.zeros(rows, c, dtype=pose.dtype)
    for r in range(rows):
        for q in range(c):
            for e in range(x):
                out[r, q] += p[r, e] * w[e, q]
    return out.reshape(-1)


def naive_em_site(votes, a_in, beta_v, beta_a, iterations, lambda_0):
    """Hinton et al. Procedure 1 for one site: ``votes[i][j]`` (d entries), ``a_in[i]``.

    Returns per iteration ``R[i][j]`` (before the M-step), ``mu[j]``, ``a[j]``.
    """
    n, m = len(votes), len(votes[0])
    d = votes[0][0].numel()
    big_r = [[1.0 / m] * m for _ in range(n)]
    rs, mus, acts = [], [], []
    for t in range(iterations):
        lam = lambda_0 * (1.0 + t)
        rs.append([row[:] for row in big_r])
        # M-step
        mu = [[0.0] * d for _ in range(m)]
        var = [[0.0] * d for _ in range(m)]
        cost = [0.0] * m
        for j in range(m):
            rw = [big_r[i][j] * float(a_in[i]) for i in range(n)]
            mass = sum(rw)
            for h in range(d):
                mu[j][h] = sum(rw[i] * float(votes[i][j][h]) for i in range(n)) / (mass + EM_EPS)
                var[j][h] = (
                    sum(rw[i] * (float(votes[i][j][h]) - mu[j][h]) ** 2 for i in range(n))
                    / (mass + EM_EPS)
                    + EM_VAR_EPS
                )
                cost[j] += (float(beta_v[j]) + math.log(math.sqrt(var[j][h]))) * mass
        mean = sum(cost) / m
        std = math.sqrt(sum((cj - mean) ** 2 for cj in cost) / m + EM_COST_EPS**2)
        a = [
            1.0
            / (1.0 + math.exp(-lam * (float(beta_a[j]) - (cost[j] - mean) / (std + EM_COST_EPS))))
            for j in range(m)
        ]
        mus.append(mu)
        acts.append(a)
        if t + 1 < iterations:
            # E-step
            for i in range(n):
                ap = []
                for j in range(m):
                    norm = 1.0
                    expo = 0.0
                    for h in range(d):
                        norm *= 2.0 * math.pi * var[j][h]
                        expo += (float(votes[i][j][h]) - mu[j][h]) ** 2 / (2.0 * var[j][h])
                    ap.append(a[j] * math.exp(-expo) / math.sqrt(norm))
                z = sum(ap)
                for j in range(m):
                    big_r[i][j] = ap[j] / z
    return rs, mus, acts


# --------------------------------------------------------------------------------------------
# Dynamic routing against the reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("iterations", [1, 3])
def test_dynamic_fc_matches_naive_loops(iterations: int) -> None:
    torch.manual_seed(0)
    b, n, m, din, dout = 2, 5, 3, 4, 3
    layer = DynamicCapsules("fc", n, din, m, dout).double()
    u = torch.randn(b, n, din, dtype=torch.float64) * 0.7
    parent, coeffs, poses = layer.route(u, iterations)
    assert parent.shape == (b, m, dout)
    assert len(coeffs) == len(poses) == iterations
    w = layer.weight.detach()  # [n, x, m, c]
    for bi in range(b):
        uhat = [[naive_vote(u[bi, i], w[i, :, j, :], 1) for j in range(m)] for i in range(n)]
        cs, vs = naive_dynamic_site(uhat, iterations)
        for t in range(iterations):
            for i in range(n):
                for j in range(m):
                    assert coeffs[t][bi, i, j].item() == pytest.approx(cs[t][i][j], abs=1e-6)
            for j in range(m):
                torch.testing.assert_close(poses[t][bi, j], vs[t][j], atol=1e-6, rtol=0)
        for j in range(m):
            torch.testing.assert_close(parent[bi, j], vs[-1][j], atol=1e-6, rtol=0)


@pytest.mark.parametrize("stride", [1, 2])
def test_dynamic_conv_matches_naive_loops(stride: int) -> None:
    torch.manual_seed(1)
    b, hh, n, m, din, dout, k, iterations = 2, 5, 2, 3, 3, 4, 3, 3
    layer = DynamicCapsules("conv", n, din, m, dout, kernel=k, stride=stride).double()
    u = torch.randn(b, hh, hh, n, din, dtype=torch.float64) * 0.7
    parent, coeffs, poses = layer.route(u, iterations)
    ho = (hh - k) // stride + 1
    assert parent.shape == (b, ho, ho, m, dout)
    assert coeffs[0].shape == (b, ho, ho, k, k, n, m)
    w = layer.weight.detach()  # [k, l, n, x, m, c]
    for bi in range(b):
        for oy in range(ho):
            for ox in range(ho):
                children = [(ky, kx, i) for ky in range(k) for kx in range(k) for i in range(n)]
                uhat = [
                    [
                        naive_vote(
                            u[bi, oy * stride + ky, ox * stride + kx, i], w[ky, kx, i, :, j, :], 1
                        )
                        for j in range(m)
                    ]
                    for (ky, kx, i) in children
                ]
                cs, vs = naive_dynamic_site(uhat, iterations)
                for t in range(iterations):
                    for ci, (ky, kx, i) in enumerate(children):
                        for j in range(m):
                            got = coeffs[t][bi, oy, ox, ky, kx, i, j].item()
                            assert got == pytest.approx(cs[t][ci][j], abs=1e-6)
                    for j in range(m):
                        torch.testing.assert_close(
                            poses[t][bi, oy, ox, j], vs[t][j], atol=1e-6, rtol=0
                        )
                for j in range(m):
                    torch.testing.assert_close(parent[bi, oy, ox, j], vs[-1][j], atol=1e-6, rtol=0)


def test_dynamic_coefficients_sum_to_one_and_start_uniform() -> None:
    torch.manual_seed(2)
    layer = DynamicCapsules("conv", 3, 4, 5, 4, kernel=2, stride=1).double()
    u = torch.randn(2, 4, 4, 3, 4, dtype=torch.float64)
    _, coeffs, _ = layer.route(u, 3)
    for c in coeffs:
        torch.testing.assert_close(c.sum(-1), torch.ones_like(c[..., 0]))
    torch.testing.assert_close(coeffs[0], torch.full_like(coeffs[0], 1 / 5))
    assert not torch.allclose(coeffs[2], coeffs[0])


# --------------------------------------------------------------------------------------------
# EM routing against the reference
# --------------------------------------------------------------------------------------------


def _em_layer(kind: str, n: int, m: int, **kw: int) -> EMCapsules:
    layer = EMCapsules(kind, n, 4, m, 4, rows=2, **kw).double()
    with torch.no_grad():
        layer.beta_v.normal_(0.0, 0.5)
        layer.beta_a.normal_(0.0, 0.5)
    return layer


def _check_em_site(got, want, site) -> None:
    (mu, act, rs, mus, acts), (w_rs, w_mus, w_acts) = got, want
    b_idx, child_index = site
    iterations = len(w_rs)
    m = len(w_mus[0])
    for t in range(iterations):
        for ci, idx in enumerate(child_index):
            for j in range(m):
                assert rs[t][b_idx + idx + (j,)].item() == pytest.approx(w_rs[t][ci][j], abs=1e-6)
        for j in range(m):
            want_mu = torch.tensor(w_mus[t][j], dtype=torch.float64)
            torch.testing.assert_close(mus[t][b_idx + (j,)], want_mu, atol=1e-6, rtol=0)
            assert acts[t][b_idx + (j,)].item() == pytest.approx(w_acts[t][j], abs=1e-6)
    for j in range(m):
        torch.testing.assert_close(
            mu[b_idx + (j,)], torch.tensor(w_mus[-1][j], dtype=torch.float64), atol=1e-6, rtol=0
        )
        assert act[b_idx + (j,)].item() == pytest.approx(w_acts[-1][j], abs=1e-6)


@pytest.mark.parametrize("iterations", [1, 3])
def test_em_fc_matches_naive_loops(iterations: int) -> None:
    torch.manual_seed(3)
    b, n, m, lambda_0 = 2, 6, 3, 0.7
    layer = _em_layer("fc", n, m)
    pose = torch.randn(b, n, 4, dtype=torch.float64)
    act = torch.rand(b, n, dtype=torch.float64)
    out = layer.route(pose, act, iterations, lambda_0)
    assert out[0].shape == (b, m, 4) and out[1].shape == (b, m)
    assert out[2][0].shape == (b, n, m)
    w = layer.weight.detach()  # [n, x, m, c]
    for bi in range(b):
        votes = [[naive_vote(pose[bi, i], w[i, :, j, :], 2) for j in range(m)] for i in range(n)]
        want = naive_em_site(
            votes, act[bi], layer.beta_v.detach(), layer.beta_a.detach(), iterations, lambda_0
        )
        _check_em_site(out, want, ((bi,), [(i,) for i in range(n)]))


def test_em_conv_matches_naive_loops() -> None:
    torch.manual_seed(4)
    b, hh, n, m, k, stride, iterations, lambda_0 = 1, 4, 2, 3, 2, 2, 2, 1.3
    layer = _em_layer("conv", n, m, kernel=k, stride=stride)
    pose = torch.randn(b, hh, hh, n, 4, dtype=torch.float64)
    act = torch.rand(b, hh, hh, n, dtype=torch.float64)
    out = layer.route(pose, act, iterations, lambda_0)
    ho = (hh - k) // stride + 1
    assert out[0].shape == (b, ho, ho, m, 4) and out[1].shape == (b, ho, ho, m)
    assert out[2][0].shape == (b, ho, ho, k, k, n, m)
    w = layer.weight.detach()  # [k, l, n, x, m, c]
    children = [(ky, kx, i) for ky in range(k) for kx in range(k) for i in range(n)]
    for oy in range(ho):
        for ox in range(ho):
            votes, a_in = [], []
            for ky, kx, i in children:
                p = pose[0, oy * stride + ky, ox * stride + kx, i]
                votes.append([naive_vote(p, w[ky, kx, i, :, j, :], 2) for j in range(m)])
                a_in.append(act[0, oy * stride + ky, ox * stride + kx, i])
            want = naive_em_site(
                votes, a_in, layer.beta_v.detach(), layer.beta_a.detach(), iterations, lambda_0
            )
            _check_em_site(out, want, ((0, oy, ox), children))


def test_em_assignments_sum_to_one() -> None:
    torch.manual_seed(5)
    layer = _em_layer("conv", 3, 4, kernel=3, stride=1)
    pose = torch.randn(2, 5, 5, 3, 4, dtype=torch.float64)
    act = torch.rand(2, 5, 5, 3, dtype=torch.float64)
    _, a_out, rs, _, _ = layer.route(pose, act, 3)
    for r in rs:
        torch.testing.assert_close(r.sum(-1), torch.ones_like(r[..., 0]))
    torch.testing.assert_close(rs[0], torch.full_like(rs[0], 1 / 4))
    assert bool(((a_out > 0) & (a_out < 1)).all())


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------

MODELS = {"capsnet-dynamic": DynamicCapsNet, "capsnet-em": EMCapsNet}


def _model(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODELS[arch](get_config("cifar10-caps-simple").replace(arch=arch))


@pytest.mark.parametrize("arch", list(MODELS))
def test_model_shapes_trace_and_iterations(arch: str) -> None:
    model = _model(arch).eval()
    x = torch.randn(2, 3, 32, 32)
    grids = [(7, 7), (5, 5)]
    for iterations in (1, 2, 3):
        model.set_routing(iterations=iterations)
        with torch.no_grad():
            out, trace = model(x, trace=True)
        assert out.shape == (2, 10)
        assert torch.isfinite(out).all()
        assert bool(((out >= 0) & (out <= 1)).all())
        assert isinstance(trace, RoutingTrace)
        assert trace.kinds == ["conv", "conv", "fc"]
        assert trace.child_grids == [None, None, (5, 5, 32)]
        for li, (h, w) in enumerate(grids):
            assert len(trace.coefficients[li]) == len(trace.poses[li]) == iterations
            for c, p in zip(trace.coefficients[li], trace.poses[li], strict=True):
                assert c.shape == (2, h, w, 3, 3, 32, 32)
                assert p.shape == (2, h, w, 32, 16)
                torch.testing.assert_close(c.sum(-1), torch.ones_like(c[..., 0]))
            first = trace.coefficients[li][0]
            torch.testing.assert_close(first, torch.full_like(first, 1 / 32))
        for c, p in zip(trace.coefficients[2], trace.poses[2], strict=True):
            assert c.shape == (2, 800, 10) and p.shape == (2, 10, 16)
            torch.testing.assert_close(c.sum(-1), torch.ones(2, 800))
    # the traced forward returns the same outputs as the plain one
    with torch.no_grad():
        torch.testing.assert_close(model(x), out)
    assert model.output_kind == ("length" if arch == "capsnet-dynamic" else "activation")


@pytest.mark.parametrize("arch", list(MODELS))
def test_model_gradients_batch_one_and_independence(arch: str) -> None:
    model = _model(arch, seed=1)
    model.set_routing(iterations=2)
    x = torch.randn(2, 3, 32, 32)
    out = model(x[:1])
    assert out.shape == (1, 10)
    out = model(x)
    y = torch.tensor([1, 2])
    loss = margin_loss(out, y) if arch == "capsnet-dynamic" else spread_loss(out, y, 0.2)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    model.eval()
    with torch.no_grad():
        full = model(x)
        single = torch.cat([model(x[i : i + 1]) for i in range(2)])
    torch.testing.assert_close(full, single, atol=1e-5, rtol=1e-4)


def test_model_api_and_configs() -> None:
    base = get_config("cifar10-caps-simple")
    dyn = dynamic_config(base)
    assert dyn.arch == "capsnet-dynamic" and dyn.routing == "sequential"
    assert all(s.pose == "vector" for s in dyn.layers) and dyn.class_pose == "vector"
    em = em_config(base)
    assert em.arch == "capsnet-em" and em.routing == "sequential"
    assert all(s.pose == "matrix" for s in em.layers) and em.class_pose == "matrix"
    assert base.arch == "capsnet" and base.layers[0].pose == "matrix"  # base untouched
    model = DynamicCapsNet(dyn)
    groups = model.param_groups()
    assert groups["total"] == sum(p.numel() for p in model.parameters())
    assert groups["backbone"] + groups["capsules"] == groups["total"]
    assert model.routing == "sequential" and model.logit_scale == 1.0
    model.set_routing(iterations=3, mode="sequential")
    assert model.iterations == 3
    with pytest.raises(ValueError):
        model.set_routing(mode="concurrent")
    with pytest.raises(ValueError):
        model.set_routing(iterations=0)
    with pytest.raises(ConfigError):
        DynamicCapsNet(base)
    with pytest.raises(ConfigError):
        EMCapsNet(base.replace(arch="capsnet-em", iterations=0))
    assert EMCapsNet(em).lambda_0 == 1.0


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def test_margin_loss_hand_computed() -> None:
    lengths = torch.tensor([[0.95, 0.3, 0.05], [0.5, 0.2, 0.8]])
    # row 0 (target 0): 0 + 0.5 * 0.2^2 + 0 = 0.02
    # row 1 (target 2): 0.1^2 + 0.5 * (0.4^2 + 0.1^2) = 0.095
    loss = margin_loss(lengths, torch.tensor([0, 2]))
    assert loss.item() == pytest.approx((0.02 + 0.095) / 2)
    # multi-hot {0, 2} on row 1: 0.4^2 + 0.1^2 + 0.5 * 0.1^2 = 0.175
    multi = margin_loss(lengths[1:], torch.tensor([[1.0, 0.0, 1.0]]))
    assert multi.item() == pytest.approx(0.175)
    same = margin_loss(lengths, torch.tensor([[1, 0, 0], [0, 0, 1]]))
    assert same.item() == pytest.approx(loss.item())
    custom = margin_loss(lengths[:1], torch.tensor([0]), m_plus=1.0, m_minus=0.0, lam=1.0)
    assert custom.item() == pytest.approx(0.05**2 + 0.3**2 + 0.05**2)


def test_spread_loss_hand_computed() -> None:
    a = torch.tensor([[0.7, 0.6, 0.1]])
    # target 0, margin 0.2: (0.2 - 0.1)^2 + 0 = 0.01
    assert spread_loss(a, torch.tensor([0]), 0.2).item() == pytest.approx(0.01)
    # margin 0.9: 0.8^2 + 0.3^2 = 0.73
    assert spread_loss(a, torch.tensor([0]), 0.9).item() == pytest.approx(0.73)
    # multi-hot {0, 1}, margin 0.9: pairs (0, 2) 0.3^2 and (1, 2) 0.4^2 -> 0.25
    assert spread_loss(a, torch.tensor([[1, 1, 0]]), 0.9).item() == pytest.approx(0.25)
    # batch mean
    two = torch.cat([a, a])
    assert spread_loss(two, torch.tensor([0, 0]), 0.9).item() == pytest.approx(0.73)
    with pytest.raises(ValueError):
        spread_loss(a, torch.tensor([[1, 0]]), 0.9)
