"""Routing by agreement in one pass (capsctl/layers/passes/agreement.py, csrc/agreement.cpp)
against Procedure 1 of Sabour, Frosst and Hinton (NeurIPS 2017, arXiv:1710.09829), written
out here in float64: ``c = softmax_j(b)``, ``s_j = sum_i c_ij u_hat_ij``, ``v_j = squash(s_j)
= |s|^2 / (1 + |s|^2) s / |s|`` (eq. 1), ``b_ij += <u_hat_ij, v_j>``, ``b = 0`` at the start."""

from __future__ import annotations

import pytest
import torch
from conftest import require_native
from torch import Tensor

from capsctl.config import build_model
from capsctl.layers.backend import dispatch
from capsctl.layers.backend.agreement import agreement_plan
from capsctl.layers.passes import agreement
from capsctl.layers.passes.agreement import AgreementPass, agreement_pass
from capsctl.registry import get_config

ITERATIONS = 3  # the paper's


@pytest.fixture(autouse=True)
def _native_required() -> None:
    require_native()


def _squash(s: Tensor) -> Tensor:
    n2 = (s * s).sum(-1, keepdim=True)  # |s|^2
    return n2 / (1 + n2) * s / n2.sqrt()  # eq. 1


def _procedure_1(x: Tensor, w: Tensor, iterations: int) -> tuple[Tensor, Tensor]:
    """Poses ``[T, B, m, a, c]`` and coefficients ``[T-1, J, B, m]`` of Procedure 1 per site."""
    u_hat = torch.einsum("jbax,jxmc->jbmac", x, w)  # [J, B, m, a, c]
    j, bsz, m = u_hat.shape[:3]
    logits = x.new_zeros(j, bsz, m)  # b_ij = 0
    poses, coeffs = [], []
    for t in range(iterations):
        c = torch.softmax(logits, dim=-1)  # [J, B, m]
        s = torch.einsum("jbm,jbmac->bmac", c, u_hat)  # [B, m, a, c]
        v = _squash(s.flatten(2)).view_as(s)  # [B, m, a, c]
        poses.append(v)
        if t > 0:
            coeffs.append(c)
        logits = logits + torch.einsum("jbmac,bmac->jbm", u_hat, v)  # b_ij += <u_hat, v>
    return torch.stack(poses), torch.stack(coeffs)


def _inputs(j: int, bsz: int, shape: tuple[int, int, int, int], seed: int) -> tuple[Tensor, ...]:
    a, xd, c, m = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(j, bsz, a, xd, generator=g) * 0.5
    w = torch.randn(j, xd, m, c, generator=g) * 0.2
    return x, w


# (J, B, (a, x, c, m)): 16-d vectors to 16, 10 and 32 parents (compiled-in sizes) over several
# blocks of sites (J * d * m floats a site: blocks of 32 and 64 sites keeping their votes, 64
# building them for each use), and a shape of run-time sizes (two rows a pose)
CASES = [
    (96, 70, (1, 16, 16, 16)),
    (200, 70, (1, 16, 16, 32)),
    (40, 70, (1, 16, 16, 10)),
    (7, 70, (2, 3, 5, 3)),
]


@pytest.mark.parametrize(("j", "bsz", "shape"), CASES, ids=[str(c[2]) for c in CASES])
@pytest.mark.parametrize("iterations", [2, ITERATIONS])
def test_one_pass_matches_procedure_1_forward_and_backward(
    j: int, bsz: int, shape: tuple[int, int, int, int], iterations: int
) -> None:
    x, w = _inputs(j, bsz, shape, seed=iterations)
    x.requires_grad_()
    w.requires_grad_()
    got = agreement_pass(x, w, iterations)
    assert got is not None
    poses, coeffs = got
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want_poses, want_coeffs = _procedure_1(x64, w64, iterations)
    torch.testing.assert_close(poses, want_poses.float(), atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(coeffs, want_coeffs.float(), atol=2e-6, rtol=1e-4)
    assert not coeffs.requires_grad
    # an upstream gradient on every iteration's poses, then on the last only (training)
    for first in (0, iterations - 1):
        up = torch.randn(poses.shape, generator=torch.Generator().manual_seed(first))
        up[:first] = 0
        gx, gw = torch.autograd.grad(poses, (x, w), up, retain_graph=True)
        wx, ww = torch.autograd.grad(want_poses, (x64, w64), up.double(), retain_graph=True)
        torch.testing.assert_close(gx, wx.float(), atol=1e-5, rtol=1e-3)
        torch.testing.assert_close(gw, ww.float(), atol=1e-5, rtol=1e-3)


def test_a_parent_whose_coefficients_vanish_gets_finite_poses() -> None:
    # large weights (the class capsules' initial scale): some parents' sums fall to 1e-23,
    # whose squared length is subnormal; an approximate square root made their poses infinite
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x = (torch.randn(20, 2, 1, 36, generator=g) * 0.3).requires_grad_()
        w = (torch.randn(20, 36, 32, 36, generator=g) * 7.0).requires_grad_()
        got = agreement_pass(x, w, ITERATIONS)
        assert got is not None
        want = _procedure_1(x.double(), w.double(), ITERATIONS)[0]
        assert torch.isfinite(got[0]).all()
        # logits of about 80: float32's coefficients differ from float64's in the 5th digit
        torch.testing.assert_close(got[0], want.float(), atol=1e-4, rtol=0)
        gx, gw = torch.autograd.grad(got[0].square().sum(), (x, w))
        assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


def test_without_gradients_the_same_poses() -> None:
    x, w = _inputs(40, 70, (1, 16, 16, 10), seed=5)
    with torch.no_grad():
        got = agreement_pass(x, w, ITERATIONS)
    assert got is not None
    torch.testing.assert_close(got[0], _procedure_1(x.double(), w.double(), 3)[0].float())


def test_two_threads_give_the_first_ones_results(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = _inputs(24, 300, (1, 16, 16, 10), seed=6)
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", threads)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        got = agreement_pass(xg, wg, ITERATIONS)
        assert got is not None
        got[0].square().sum().backward()
        results.append((got[0].detach(), xg.grad, wg.grad))
    for one, two in zip(*results, strict=True):
        torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-5)


def test_it_leaves_other_backends_and_dtypes_to_the_routed_passes() -> None:
    x, w = _inputs(7, 10, (1, 16, 16, 10), seed=7)
    assert agreement_pass(x.double(), w.double(), ITERATIONS) is None  # the loops are float32
    assert agreement_pass(x, w, 1) is None  # one iteration: the uniform pass only
    with dispatch.use("chunked"):
        assert agreement_pass(x, w, ITERATIONS) is None


def test_a_block_keeps_its_votes_where_16_sites_fit_3_mib() -> None:
    # 3 MiB of floats / (J * d * m), down to a multiple of 8, at most 64; under 16: 64 sites
    # that build their votes again for each use
    assert agreement_plan(144, 16, 16) == (16, True)  # mnist-caps' conv capsule layer: 21 fit
    assert agreement_plan(40, 16, 10) == (64, True)  # 122 fit
    assert agreement_plan(576, 16, 10) == (64, False)  # mnist-caps' class capsules: 8 fit
    assert agreement_plan(288, 16, 32) == (64, False)  # cifar10-dynamic-simple's conv: 5 fit


def test_dynamic_routing_models_route_each_layer_in_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every capsule layer of a dynamic-routing model is one pass (none of the routed passes),
    with the outputs and gradients of routing iteration by iteration."""
    calls: list[int] = []
    real = AgreementPass.apply

    def counted(*args: object) -> object:
        calls.append(1)
        return real(*args)

    cfg = get_config("mnist-caps").replace(router={"name": "dynamic"})
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randn(3, 1, 28, 28)

    def step() -> tuple[Tensor, list[Tensor]]:
        model.zero_grad()
        out = model(x)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    monkeypatch.setattr(agreement.AgreementPass, "apply", counted)
    dispatch.reset_ran()
    out, grads = step()
    assert len(calls) == len(cfg.layers) + 1  # the conv capsule layer and the class capsules
    assert dispatch.ran() == {"native": len(calls)}
    with dispatch.use("chunked"):  # the torch code, iteration by iteration
        want, want_grads = step()
    assert len(calls) == len(cfg.layers) + 1
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    for g, wg in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, wg, atol=1e-5, rtol=1e-3)
