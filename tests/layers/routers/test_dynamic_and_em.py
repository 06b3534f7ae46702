"""Dynamic routing and EM routing baselines: references written from the papers' equations,
invariants, defaults, whole models, losses.

The references loop over children ``i``, parents ``j``, pose entries ``h`` and iterations ``t``
in plain Python floats (float64 layers, tiny sizes), and every constant is typed here:

- dynamic routing: Sabour, Frosst, Hinton, "Dynamic routing between capsules", NeurIPS 2017
  (arXiv:1710.09829), Procedure 1 and eq. 1 (squash without any epsilon);
- EM routing: Hinton, Sabour, Frosst, "Matrix capsules with EM routing", ICLR 2018,
  Procedure 1. A conv child's assignments are normalized over every parent it votes for (all
  windows it falls in, all types) and start uniform over them. The constants the paper leaves
  open are those of the authors' implementation (google-research/google-research,
  ``capsule_em/em_layers.py``, ``capsule_em/experiment.py``): inverse temperature
  ``lambda_t = lambda_inf * (1 - 0.95^(t+1))`` with ``lambda_inf = 2 * 0.01`` (their
  ``final_beta`` multiplies ``log sigma^2`` where the paper has ``log sigma``), a quarter of that
  in FC layers; ``5e-4`` added to every variance; ``1e-7`` added to the mass ``sum_i R_ij a_i``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from capsctl.config import load_preset
from capsctl.errors import ConfigError
from capsctl.layers.algorithm import Capsules, LayerPlan
from capsctl.layers.routers.dynamic import DynamicConv, DynamicFC
from capsctl.layers.routers.em.layer import EMCapsules
from capsctl.losses import margin_loss, spread_loss
from capsctl.models.capsnet import CapsNet, RoutingTrace
from capsctl.registry import get_config, list_models

# Constants of the references, typed from the sources above (never read from the code).
VAR_EPS = 5e-4  # added to every variance (capsule_em/em_layers.py, min_var)
MASS_EPS = 1e-7  # added to sum_i R_ij a_i (capsule_em/em_layers.py, conv routing)
LAMBDA_DECAY = 0.95  # lambda_t = lambda_inf * (1 - 0.95^(t+1))
CONV_LAMBDA = 0.02  # default lambda_inf of conv layers: 2 * final_beta, final_beta = 0.01
FC_LAMBDA = 0.005  # FC layers: a quarter of it (final_beta / 4 in connector_capsule_mat)
COST_EPS = 1e-6  # the optional cost standardization: (c - mean) / (sqrt(var + eps^2) + eps)
CONV_INIT_STD = 0.3  # weight std before truncation at 2 std (conv_capsule_mat)
FC_INIT_STD = 0.01  # (connector_capsule_mat)
PAPER_ITERATIONS = 3  # both papers


class DynamicCapsules:
    """A dynamic-routing layer of the model, called as ``route(u, T) -> (v, coefficients,
    poses)``."""

    def __init__(self, kind, n, din, m, dout, kernel=1, stride=1) -> None:
        plan = LayerPlan(kind, n, din, m, dout, "vector", kernel, stride)
        self.layer = DynamicConv(plan) if kind == "conv" else DynamicFC(plan)
        self.weight = self.layer.weight

    def double(self):
        self.layer.double()
        self.weight = self.layer.weight
        return self

    def route(self, u, iterations):
        out = self.layer(Capsules(u), iterations)
        return out.capsules.poses, out.coefficients, out.poses


# --------------------------------------------------------------------------------------------
# Naive references
# --------------------------------------------------------------------------------------------


def naive_vote(pose: torch.Tensor, w: torch.Tensor, rows: int) -> list[float]:
    """Child pose (``rows`` x ``x``, row-major) times ``w[x, c]`` -> vote (``rows*c`` floats)."""
    x, c = w.shape
    p = pose.tolist()
    ww = w.tolist()
    out = []
    for r in range(rows):
        for q in range(c):
            out.append(sum(p[r * x + e] * ww[e][q] for e in range(x)))
    return out


def naive_squash(s: list[float]) -> list[float]:
    """``|s|^2 / (1 + |s|^2) * s / |s|`` (Sabour et al. 2017, eq. 1)."""
    n2 = sum(v * v for v in s)
    if n2 == 0.0:
        return [0.0] * len(s)
    return [v * n2 / (1.0 + n2) / math.sqrt(n2) for v in s]


def naive_dynamic_site(uhat: list[list[list[float]]], iterations: int):
    """Procedure 1 of Sabour et al. for one site; ``uhat[i][j]``: child i's vote for parent j.

    Returns per iteration ``c[i][j]`` and ``v[j]``.
    """
    n, m, d = len(uhat), len(uhat[0]), len(uhat[0][0])
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
            s = [sum(c[i][j] * uhat[i][j][h] for i in range(n)) for h in range(d)]
            v.append(naive_squash(s))
        cs.append(c)
        vs.append(v)
        if t + 1 < iterations:
            for i in range(n):
                for j in range(m):
                    blog[i][j] += sum(uhat[i][j][h] * v[j][h] for h in range(d))
    return cs, vs


def naive_em(links, a_in, ptype, beta_u, beta_a, iterations, lam_inf, sites=None):
    """Procedure 1 of Hinton et al. (2018) on one image.

    ``links[p]``: list of ``(child key, vote)`` for parent ``p`` (vote: ``d`` floats);
    ``a_in[child key]``; ``ptype[p]``: the type of ``p`` (index into ``beta_u``, ``beta_a``).
    ``sites`` (optional): groups of parents whose costs are standardized together.
    Returns per iteration ``(R, mu, a)``: ``R[(p, child)]`` used by that M-step, ``mu[p]``
    (list of ``d``), ``a[p]``.
    """
    parents_of: dict[object, list[int]] = defaultdict(list)
    vote_of = {}
    for p, row in enumerate(links):
        for c, v in row:
            parents_of[c].append(p)
            vote_of[p, c] = v
    d = len(links[0][0][1])
    big_r = {(p, c): 1.0 / len(parents_of[c]) for p, row in enumerate(links) for c, _ in row}
    out = []
    for t in range(iterations):
        lam = lam_inf * (1.0 - LAMBDA_DECAY ** (t + 1))
        mu, var, cost = [], [], []
        for p, row in enumerate(links):
            rw = [big_r[p, c] * a_in[c] for c, _ in row]
            mass = sum(rw)
            mu_p = [
                sum(r * v[h] for r, (_, v) in zip(rw, row, strict=True)) / (mass + MASS_EPS)
                for h in range(d)
            ]
            var_p = [
                sum(r * (v[h] - mu_p[h]) ** 2 for r, (_, v) in zip(rw, row, strict=True))
                / (mass + MASS_EPS)
                + VAR_EPS
                for h in range(d)
            ]
            cost_p = 0.0
            for h in range(d):
                cost_p += (beta_u[ptype[p]] + math.log(math.sqrt(var_p[h]))) * mass
            mu.append(mu_p)
            var.append(var_p)
            cost.append(cost_p)
        if sites is not None:
            std_cost = list(cost)
            for group in sites:
                mean = sum(cost[p] for p in group) / len(group)
                pvar = sum((cost[p] - mean) ** 2 for p in group) / len(group)
                for p in group:
                    std_cost[p] = (cost[p] - mean) / (math.sqrt(pvar + COST_EPS**2) + COST_EPS)
            cost = std_cost
        a = [1.0 / (1.0 + math.exp(-lam * (beta_a[ptype[p]] - cost[p]))) for p in range(len(links))]
        out.append((dict(big_r), mu, a))
        if t + 1 < iterations:
            for c, ps in parents_of.items():
                num = {}
                for p in ps:
                    v = vote_of[p, c]
                    norm, expo = 1.0, 0.0
                    for h in range(d):
                        norm *= 2.0 * math.pi * var[p][h]
                        expo += (v[h] - mu[p][h]) ** 2 / (2.0 * var[p][h])
                    num[p] = a[p] * math.exp(-expo) / math.sqrt(norm)
                z = sum(num.values())
                assert z > 0.0, "reference underflow: choose other test values"
                for p in ps:
                    big_r[p, c] = num[p] / z
    return out


# --------------------------------------------------------------------------------------------
# Dynamic routing against the reference
# --------------------------------------------------------------------------------------------


def _check_dynamic_site(coeffs, poses, parent, cs, vs, site, children) -> None:
    for t in range(len(cs)):
        for ci, idx in enumerate(children):
            for j in range(len(vs[0])):
                got = coeffs[t][site + idx + (j,)].item()
                assert got == pytest.approx(cs[t][ci][j], rel=1e-9, abs=1e-12)
        for j in range(len(vs[0])):
            want = torch.tensor(vs[t][j], dtype=torch.float64)
            torch.testing.assert_close(poses[t][site + (j,)], want, atol=1e-10, rtol=1e-8)
    for j in range(len(vs[0])):
        want = torch.tensor(vs[-1][j], dtype=torch.float64)
        torch.testing.assert_close(parent[site + (j,)], want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize(("n", "m", "iterations"), [(5, 3, 3), (5, 3, 1), (1, 3, 3), (4, 1, 3)])
def test_dynamic_fc_matches_paper(n: int, m: int, iterations: int) -> None:
    torch.manual_seed(0)
    b, din, dout = 2, 4, 3
    layer = DynamicCapsules("fc", n, din, m, dout).double()
    u = torch.randn(b, n, din, dtype=torch.float64) * 0.7
    parent, coeffs, poses = layer.route(u, iterations)
    assert parent.shape == (b, m, dout)
    assert len(coeffs) == len(poses) == iterations
    w = layer.weight.detach()  # [n, x, m, c]
    for bi in range(b):
        uhat = [[naive_vote(u[bi, i], w[i, :, j, :], 1) for j in range(m)] for i in range(n)]
        cs, vs = naive_dynamic_site(uhat, iterations)
        _check_dynamic_site(coeffs, poses, parent, cs, vs, (bi,), [(i,) for i in range(n)])


@pytest.mark.parametrize(("n", "m", "stride"), [(2, 3, 1), (2, 3, 2), (1, 2, 1), (2, 1, 2)])
def test_dynamic_conv_matches_paper(n: int, m: int, stride: int) -> None:
    torch.manual_seed(1)
    b, hh, din, dout, k = 2, 5, 3, 4, 3
    layer = DynamicCapsules("conv", n, din, m, dout, kernel=k, stride=stride).double()
    u = torch.randn(b, hh, hh, n, din, dtype=torch.float64) * 0.7
    parent, coeffs, poses = layer.route(u, PAPER_ITERATIONS)
    ho = (hh - k) // stride + 1
    assert parent.shape == (b, ho, ho, m, dout)
    assert coeffs[0].shape == (b, ho, ho, k, k, n, m)
    w = layer.weight.detach()  # [k, l, n, x, m, c]
    children = [(ky, kx, i) for ky in range(k) for kx in range(k) for i in range(n)]
    for bi in range(b):
        for oy in range(ho):
            for ox in range(ho):
                uhat = [
                    [
                        naive_vote(
                            u[bi, oy * stride + ky, ox * stride + kx, i], w[ky, kx, i, :, j, :], 1
                        )
                        for j in range(m)
                    ]
                    for (ky, kx, i) in children
                ]
                cs, vs = naive_dynamic_site(uhat, PAPER_ITERATIONS)
                _check_dynamic_site(coeffs, poses, parent, cs, vs, (bi, oy, ox), children)


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


def _em_layer(kind: str, n: int, m: int, **kw) -> EMCapsules:
    """A float64 layer with 2x2 poses, weights N(0, 0.5^2) and random betas."""
    layer = EMCapsules(kind, n, 4, m, 4, rows=2, **kw).double()
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.5)
        layer.beta_u.normal_(0.0, 0.5)
        layer.beta_a.normal_(0.0, 0.5)
    return layer


def _betas(layer: EMCapsules) -> tuple[list[float], list[float]]:
    return layer.beta_u.detach().tolist(), layer.beta_a.detach().tolist()


def _fc_links(pose_b: torch.Tensor, act_b: torch.Tensor, w: torch.Tensor, rows: int):
    """One image of an FC layer: parents ``j``, children ``i``; R index ``(i, j)``."""
    n, m = w.shape[0], w.shape[2]
    links = [[(i, naive_vote(pose_b[i], w[i, :, j, :], rows)) for i in range(n)] for j in range(m)]
    a_in = {i: float(act_b[i]) for i in range(n)}
    r_index = {(j, i): (i, j) for j in range(m) for i in range(n)}
    return links, a_in, list(range(m)), [list(range(m))], r_index, [(j,) for j in range(m)]


def _conv_links(pose_b, act_b, w, rows: int, stride: int, per_window: bool):
    """One image of a conv layer: parent ``p = (oy, ox, j)``; a child is ``(y, x, i)``, or with
    ``per_window`` one child per window it falls in, ``(oy, ox, ky, kx, i)``."""
    k, n, m, hh = w.shape[0], w.shape[2], w.shape[4], pose_b.shape[0]
    ho = (hh - k) // stride + 1
    links, ptype, sites, p_index, r_index, a_in = [], [], [], [], {}, {}
    for oy in range(ho):
        for ox in range(ho):
            sites.append([])
            for j in range(m):
                p = len(links)
                row = []
                for ky in range(k):
                    for kx in range(k):
                        for i in range(n):
                            y, x = oy * stride + ky, ox * stride + kx
                            c = (oy, ox, ky, kx, i) if per_window else (y, x, i)
                            a_in[c] = float(act_b[y, x, i])
                            row.append(
                                (c, naive_vote(pose_b[y, x, i], w[ky, kx, i, :, j, :], rows))
                            )
                            r_index[p, c] = (oy, ox, ky, kx, i, j)
                links.append(row)
                ptype.append(j)
                sites[-1].append(p)
                p_index.append((oy, ox, j))
    return links, a_in, ptype, sites, r_index, p_index


def _check_em(out, ref, bi: int, r_index, p_index) -> None:
    mu, act, rs, mus, acts = out
    assert len(rs) == len(mus) == len(acts) == len(ref)
    for t, (big_r, w_mu, w_a) in enumerate(ref):
        for key, want in big_r.items():
            got = rs[t][(bi,) + r_index[key]].item()
            assert got == pytest.approx(want, rel=1e-8, abs=1e-12), (t, key)
        for p, idx in enumerate(p_index):
            want_mu = torch.tensor(w_mu[p], dtype=torch.float64)
            torch.testing.assert_close(mus[t][(bi,) + idx], want_mu, atol=1e-10, rtol=1e-8)
            assert acts[t][(bi,) + idx].item() == pytest.approx(w_a[p], rel=1e-8, abs=1e-12)
    for p, idx in enumerate(p_index):
        want_mu = torch.tensor(ref[-1][1][p], dtype=torch.float64)
        torch.testing.assert_close(mu[(bi,) + idx], want_mu, atol=1e-10, rtol=1e-8)
        assert act[(bi,) + idx].item() == pytest.approx(ref[-1][2][p], rel=1e-8, abs=1e-12)


@pytest.mark.parametrize(
    ("n", "m", "iterations", "lam"),
    [(6, 3, 3, 1.5), (6, 3, 1, 1.5), (1, 3, 3, 2.0), (5, 1, 3, 0.7)],
)
def test_em_fc_matches_paper(n: int, m: int, iterations: int, lam: float) -> None:
    torch.manual_seed(3)
    b = 2
    layer = _em_layer("fc", n, m)
    pose = torch.randn(b, n, 4, dtype=torch.float64)
    act = torch.rand(b, n, dtype=torch.float64) * 0.9 + 0.1
    out = layer.route(pose, act, iterations, lam)
    assert out[0].shape == (b, m, 4) and out[1].shape == (b, m)
    assert out[2][0].shape == (b, n, m)
    beta_u, beta_a = _betas(layer)
    w = layer.weight.detach()  # [n, x, m, c]
    for bi in range(b):
        links, a_in, ptype, _, r_index, p_index = _fc_links(pose[bi], act[bi], w, 2)
        ref = naive_em(links, a_in, ptype, beta_u, beta_a, iterations, lam)
        _check_em(out, ref, bi, r_index, p_index)


@pytest.mark.parametrize(
    ("n", "m", "k", "stride"), [(2, 3, 2, 1), (2, 2, 3, 2), (1, 3, 2, 1), (2, 1, 2, 1)]
)
def test_em_conv_matches_paper(n: int, m: int, k: int, stride: int) -> None:
    """Every child's assignments are normalized over all parents it votes for."""
    torch.manual_seed(4)
    b, hh, lam = 2, 4, 1.3
    layer = _em_layer("conv", n, m, kernel=k, stride=stride)
    pose = torch.randn(b, hh, hh, n, 4, dtype=torch.float64)
    act = torch.rand(b, hh, hh, n, dtype=torch.float64) * 0.9 + 0.1
    out = layer.route(pose, act, PAPER_ITERATIONS, lam)
    ho = (hh - k) // stride + 1
    assert out[0].shape == (b, ho, ho, m, 4) and out[1].shape == (b, ho, ho, m)
    assert out[2][0].shape == (b, ho, ho, k, k, n, m)
    beta_u, beta_a = _betas(layer)
    w = layer.weight.detach()  # [k, l, n, x, m, c]
    for bi in range(b):
        links, a_in, ptype, _, r_index, p_index = _conv_links(
            pose[bi], act[bi], w, 2, stride, False
        )
        ref = naive_em(links, a_in, ptype, beta_u, beta_a, PAPER_ITERATIONS, lam)
        _check_em(out, ref, bi, r_index, p_index)


def test_em_conv_per_window_variant_matches_paper_per_window() -> None:
    """``assignment="window"``: every window is its own routing problem (1/m at the start)."""
    torch.manual_seed(5)
    b, hh, n, m, k, stride, lam = 1, 4, 2, 3, 2, 1, 1.1
    layer = _em_layer("conv", n, m, kernel=k, stride=stride, assignment="window")
    pose = torch.randn(b, hh, hh, n, 4, dtype=torch.float64)
    act = torch.rand(b, hh, hh, n, dtype=torch.float64) * 0.9 + 0.1
    out = layer.route(pose, act, PAPER_ITERATIONS, lam)
    beta_u, beta_a = _betas(layer)
    links, a_in, ptype, _, r_index, p_index = _conv_links(
        pose[0], act[0], layer.weight.detach(), 2, stride, True
    )
    ref = naive_em(links, a_in, ptype, beta_u, beta_a, PAPER_ITERATIONS, lam)
    _check_em(out, ref, 0, r_index, p_index)
    torch.testing.assert_close(out[2][0], torch.full_like(out[2][0], 1 / m))


@pytest.mark.parametrize("kind", ["fc", "conv"])
def test_em_standardized_costs_knob(kind: str) -> None:
    """``standardize_costs=True`` standardizes the costs over the parent types of a site."""
    torch.manual_seed(6)
    b, n, m, lam = 1, 3, 3, 1.7
    kw = {"kernel": 2, "stride": 1} if kind == "conv" else {}
    layer = _em_layer(kind, n, m, standardize_costs=True, **kw)
    shape = (b, 3, 3, n) if kind == "conv" else (b, n)
    pose = torch.randn(*shape, 4, dtype=torch.float64)
    act = torch.rand(*shape, dtype=torch.float64) * 0.9 + 0.1
    out = layer.route(pose, act, PAPER_ITERATIONS, lam)
    beta_u, beta_a = _betas(layer)
    w = layer.weight.detach()
    if kind == "conv":
        links, a_in, ptype, sites, r_index, p_index = _conv_links(pose[0], act[0], w, 2, 1, False)
    else:
        links, a_in, ptype, sites, r_index, p_index = _fc_links(pose[0], act[0], w, 2)
    ref = naive_em(links, a_in, ptype, beta_u, beta_a, PAPER_ITERATIONS, lam, sites=sites)
    _check_em(out, ref, 0, r_index, p_index)
    plain = naive_em(links, a_in, ptype, beta_u, beta_a, PAPER_ITERATIONS, lam)
    assert abs(plain[-1][2][0] - ref[-1][2][0]) > 1e-3  # the knob changes the result


@pytest.mark.parametrize(("kind", "lam"), [("conv", CONV_LAMBDA), ("fc", FC_LAMBDA)])
def test_em_default_inverse_temperature(kind: str, lam: float) -> None:
    """Without an explicit temperature a layer uses the reference implementation's schedule."""
    torch.manual_seed(7)
    n, m = 3, 2
    kw = {"kernel": 2, "stride": 1} if kind == "conv" else {}
    layer = _em_layer(kind, n, m, **kw)
    with torch.no_grad():  # beta_a large enough that the temperature matters
        layer.beta_a.normal_(0.0, 200.0)
    shape = (1, 3, 3, n) if kind == "conv" else (1, n)
    pose = torch.randn(*shape, 4, dtype=torch.float64)
    act = torch.rand(*shape, dtype=torch.float64) * 0.9 + 0.1
    out = layer.route(pose, act, PAPER_ITERATIONS)
    beta_u, beta_a = _betas(layer)
    w = layer.weight.detach()
    if kind == "conv":
        links, a_in, ptype, _, r_index, p_index = _conv_links(pose[0], act[0], w, 2, 1, False)
    else:
        links, a_in, ptype, _, r_index, p_index = _fc_links(pose[0], act[0], w, 2)
    ref = naive_em(links, a_in, ptype, beta_u, beta_a, PAPER_ITERATIONS, lam)
    _check_em(out, ref, 0, r_index, p_index)


def test_em_assignments_sum_to_one_over_all_parents() -> None:
    torch.manual_seed(8)
    n, m, k, hh = 3, 4, 3, 5
    layer = _em_layer("conv", n, m, kernel=k, stride=1)
    pose = torch.randn(2, hh, hh, n, 4, dtype=torch.float64)
    act = torch.rand(2, hh, hh, n, dtype=torch.float64)
    _, a_out, rs, _, _ = layer.route(pose, act, PAPER_ITERATIONS, 1.0)
    ho = hh - k + 1
    for r in rs:
        total = torch.zeros(2, hh, hh, n, dtype=torch.float64)
        for oy in range(ho):
            for ox in range(ho):
                for ky in range(k):
                    for kx in range(k):
                        total[:, oy + ky, ox + kx] += r[:, oy, ox, ky, kx].sum(-1)
        torch.testing.assert_close(total, torch.ones_like(total))
    # the first pass is uniform over the parents: 1 / (m * windows the child falls in)
    assert rs[0][0, 0, 0, 0, 0, 0, 0].item() == pytest.approx(1 / m)  # a corner: one window
    assert rs[0][0, 1, 1, 1, 1, 0, 0].item() == pytest.approx(1 / (9 * m))  # centre: nine
    assert not torch.allclose(rs[2], rs[0])
    assert bool(((a_out > 0) & (a_out < 1)).all())


@pytest.mark.parametrize("assignment", ["parents", "window"])
def test_em_conv_gradients_match_finite_differences(assignment: str) -> None:
    """The all-parents E-step has a hand-written backward; check it numerically."""
    torch.manual_seed(10)
    layer = _em_layer("conv", 2, 2, kernel=2, stride=1, assignment=assignment)
    pose = torch.randn(1, 3, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    act = (torch.rand(1, 3, 3, 2, dtype=torch.float64) * 0.8 + 0.1).requires_grad_()

    def run(p: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, a_out, rs, _, _ = layer.route(p, a, PAPER_ITERATIONS, 1.3)
        return mu, a_out, rs[-1]

    assert torch.autograd.gradcheck(run, (pose, act), eps=1e-6, atol=1e-6)


def test_em_init_and_bad_arguments() -> None:
    torch.manual_seed(9)
    conv = EMCapsules("conv", 32, 16, 32, 16, rows=4, kernel=3, stride=1)
    fc = EMCapsules("fc", 800, 16, 10, 16, rows=4)
    # truncated normal at 2 std: std of the kept values = 0.8796 * std
    for layer, std in ((conv, CONV_INIT_STD), (fc, FC_INIT_STD)):
        w = layer.weight.detach()
        assert w.abs().max().item() <= 2 * std
        assert w.std().item() == pytest.approx(0.8796 * std, rel=0.03)
        assert not layer.beta_u.detach().any() and not layer.beta_a.detach().any()
    with pytest.raises(ValueError):
        EMCapsules("conv", 2, 4, 2, 4, rows=2, kernel=2, assignment="nope")
    with pytest.raises(ValueError):
        fc.route(torch.randn(1, 800, 16), torch.rand(1, 800), 0)


# --------------------------------------------------------------------------------------------
# Defaults: registry, presets, model knobs
# --------------------------------------------------------------------------------------------


def test_registry_and_presets_route_three_times() -> None:
    names = list_models("*-dynamic*") + list_models("*-em*")
    assert len(names) == 8
    for name in names:
        assert get_config(name).iterations == PAPER_ITERATIONS, name
    presets = Path(__file__).resolve().parents[3] / "presets"
    files = sorted(presets.glob("*dynamic*.yaml")) + sorted(presets.glob("*-em*.yaml"))
    assert len(files) >= 8
    for file in files:
        preset = load_preset(str(file))
        assert preset.model.router["name"] in ("dynamic", "em"), file.name
        assert preset.model.iterations == PAPER_ITERATIONS, file.name
    assert CapsNet(get_config("cifar10-em-simple")).iterations == PAPER_ITERATIONS
    assert CapsNet(get_config("cifar10-dynamic-simple")).iterations == PAPER_ITERATIONS


def test_em_model_knobs() -> None:
    cfg = get_config("cifar100-em-simple").replace(primary_types=4, num_classes=5)
    cfg = cfg.replace(layers=[dataclasses.replace(s, types=4) for s in cfg.layers])
    model = CapsNet(cfg)
    kinds = [layer.kind for layer in model.capsules]
    assert kinds == ["conv", "conv", "fc", "fc"]
    assert [layer.final_lambda for layer in model.capsules] == pytest.approx(
        [CONV_LAMBDA, CONV_LAMBDA, FC_LAMBDA, FC_LAMBDA]
    )
    assert all(layer.assignment == "parents" for layer in model.capsules)
    assert not any(layer.standardize_costs for layer in model.capsules)
    knobs = {"name": "em", "lambda_inf": 0.4, "assignment": "window", "standardize_costs": True}
    tuned = CapsNet(cfg.replace(router=knobs))
    assert [layer.final_lambda for layer in tuned.capsules] == pytest.approx([0.4, 0.4, 0.1, 0.1])
    assert all(layer.assignment == "window" for layer in tuned.capsules)
    assert all(layer.standardize_costs for layer in tuned.capsules)
    with pytest.raises(ConfigError, match="lambda_inf"):
        CapsNet(cfg.replace(router={"name": "em", "lambda_inf": 0.0}))


# --------------------------------------------------------------------------------------------
# Whole models
# --------------------------------------------------------------------------------------------

MODELS = ("dynamic", "em")


def _model(router: str, seed: int = 0, types: int = 32) -> CapsNet:
    torch.manual_seed(seed)
    cfg = get_config(f"cifar10-{router}-simple")
    layers = [dataclasses.replace(spec, types=types) for spec in cfg.layers]
    return CapsNet(cfg.replace(primary_types=types, layers=layers))


def _per_child_sums(c: torch.Tensor, stride: int) -> torch.Tensor:
    """``[b, h, w, k, l, n, m]`` -> the sum over every window and parent of each child."""
    b, h, w, k, _, n, _ = c.shape
    size = (h - 1) * stride + k
    total = torch.zeros(b, size, size, n, dtype=c.dtype)
    for oy in range(h):
        for ox in range(w):
            for ky in range(k):
                for kx in range(k):
                    total[:, oy * stride + ky, ox * stride + kx] += c[:, oy, ox, ky, kx].sum(-1)
    return total


@pytest.mark.parametrize("arch", MODELS)
def test_model_shapes_trace_and_iterations(arch: str) -> None:
    model = _model(arch).eval()
    x = torch.randn(2, 3, 32, 32)
    grids = [(7, 7, 2), (5, 5, 1)]
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
        for li, (h, w, stride) in enumerate(grids):
            assert len(trace.coefficients[li]) == len(trace.poses[li]) == iterations
            for c, p in zip(trace.coefficients[li], trace.poses[li], strict=True):
                assert c.shape == (2, h, w, 3, 3, 32, 32)
                assert p.shape == (2, h, w, 32, 16)
                if arch == "dynamic":  # per window
                    torch.testing.assert_close(c.sum(-1), torch.ones_like(c[..., 0]))
                else:  # over every parent the child votes for
                    total = _per_child_sums(c, stride)
                    torch.testing.assert_close(total, torch.ones_like(total))
            first = trace.coefficients[li][0]
            per_window = first / first.sum(-1, keepdim=True)
            torch.testing.assert_close(per_window, torch.full_like(first, 1 / 32))
        for c, p in zip(trace.coefficients[2], trace.poses[2], strict=True):
            assert c.shape == (2, 800, 10) and p.shape == (2, 10, 16)
            torch.testing.assert_close(c.sum(-1), torch.ones(2, 800))
    # the traced forward returns the same outputs as the plain one
    with torch.no_grad():
        torch.testing.assert_close(model(x), out)
    assert model.output_kind == ("length" if arch == "dynamic" else "activation")


@pytest.mark.parametrize("arch", MODELS)
def test_model_trains_a_step_batch_one_and_independence(arch: str) -> None:
    model = _model(arch, seed=1, types=8)
    model.set_routing(iterations=PAPER_ITERATIONS)
    x = torch.randn(2, 3, 32, 32)
    out = model(x[:1])
    assert out.shape == (1, 10)
    y = torch.tensor([1, 2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        loss = margin_loss(out, y) if arch == "dynamic" else spread_loss(out, y, 0.2)
        assert torch.isfinite(loss)
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all(), name
        opt.step()
    model.eval()
    with torch.no_grad():
        full = model(x)
        single = torch.cat([model(x[i : i + 1]) for i in range(2)])
    assert torch.isfinite(full).all()
    torch.testing.assert_close(full, single, atol=1e-5, rtol=1e-4)


def test_model_api_and_configs() -> None:
    base = get_config("cifar10-caps-simple")
    dyn = base.replace(router={"name": "dynamic"})
    assert dyn.router == {"name": "dynamic", "iterations": PAPER_ITERATIONS}
    assert dyn.routing == "sequential"
    model = CapsNet(dyn)
    # every pose a vector of the same dim: one-row child poses, 16 columns
    assert [layer.rows for layer in model.capsules] == [1, 1, 1]
    assert [layer.cols_in for layer in model.capsules] == [16, 16, 16]
    em = CapsNet(base.replace(router={"name": "em"}))
    assert [layer.rows for layer in em.capsules] == [4, 4, 4]  # 4x4 pose matrices
    assert base.router["name"] == "idpa" and base.layers[0].pose == "matrix"  # base untouched
    groups = model.parameter_counts()
    assert groups["total"] == sum(p.numel() for p in model.parameters())
    assert groups["backbone"] + groups["capsules"] == groups["total"]
    assert model.routing == "sequential" and model.head.logit_scale == 1.0
    model.set_routing(iterations=3, mode="sequential")
    assert model.iterations == 3
    with pytest.raises(ValueError, match="only mode 'sequential'"):
        model.set_routing(mode="concurrent")
    with pytest.raises(ValueError):
        model.set_routing(iterations=0)
    with pytest.raises(ConfigError):
        CapsNet(base.replace(router={"name": "em", "iterations": 0}))


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
