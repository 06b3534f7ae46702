"""EM routing's E-step as Triton kernels (capsctl/layers/backend/triton/estep.py), run on the
CPU by Triton's interpreter: ``R_ij = a_j p_ij / sum_k a_k p_ik`` as a softmax of
``z = c - quad / 2`` over every parent child ``i`` votes for (Hinton, Sabour, Frosst, ICLR
2018, Procedure 1), within a site (FC) and across every conv window the child falls in;
against that equation written here with each entry's child worked out by hand, against the
torch code (windows.py's EStep), its gradients; EM layers run it as the kernels; a failing
kernel falls back."""

from __future__ import annotations

import logging
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend.triton import estep as estep_kernels  # noqa: E402
from capsctl.layers.routers.em.windows import (  # noqa: E402
    EStep,
    WindowGrid,
    e_step,
    triton_e_step,
)

F64 = torch.float64


def child_of_entries(b: int, hh: int, n: int, k: int, stride: int) -> torch.Tensor:
    """``[B, J]``: the child ``(b, y, x, t)`` (as one number) of every entry of the site
    layout, sites ``B = (b, oy, ox)`` and children ``J = (ky, kx, t)``, by hand."""
    ho = (hh - k) // stride + 1
    ids = torch.empty(b * ho * ho, k * k * n, dtype=torch.long)
    for bi in range(b):
        for oy in range(ho):
            for ox in range(ho):
                for ky in range(k):
                    for kx in range(k):
                        for t in range(n):
                            y, x = oy * stride + ky, ox * stride + kx
                            ids[(bi * ho + oy) * ho + ox, (ky * k + kx) * n + t] = (
                                (bi * hh + y) * hh + x
                            ) * n + t
    return ids


def e_step_equation(quad: torch.Tensor, c: torch.Tensor, child: torch.Tensor | None):
    """``R = exp(z) / sum exp(z)`` with ``z = c - quad / 2``, the sum over all entries of the
    same child (every window it falls in, every parent type); within each entry's ``m``
    parents when ``child`` is None."""
    z = c - 0.5 * quad  # [B, J, m]
    if child is None:
        return torch.softmax(z, dim=-1)
    e = torch.exp(z)  # the test's values are small: no shift needed
    per_child = torch.zeros(int(child.max()) + 1, dtype=z.dtype)
    per_child = per_child.index_add(0, child.flatten(), e.sum(-1).flatten())
    return e / per_child[child].unsqueeze(-1)


# (b, H, n, k, stride, m): conv layers (windows overlapping, strided, one type, one parent),
# and site-local softmaxes (k = 0: no grid)
CASES = {
    "conv-3x3": (2, 5, 2, 3, 1, 4),
    "conv-strided": (1, 5, 3, 3, 2, 3),
    "conv-one-parent": (1, 4, 2, 2, 1, 1),
    "fc": (6, 0, 5, 0, 0, 10),
    "fc-rows-past-a-block": (300, 0, 7, 0, 0, 3),
}


def _case(name: str, dtype: torch.dtype = F64, seed: int = 0):
    b, hh, n, k, stride, m = CASES[name]
    g = torch.Generator().manual_seed(seed)
    if k == 0:
        grid, child, sites, j = None, None, b, n
    else:
        grid = WindowGrid.of(torch.zeros(b, hh, hh, n), k, stride)
        child = child_of_entries(b, hh, n, k, stride)
        sites, j = child.shape
    quad = torch.rand(sites, j, m, generator=g, dtype=dtype) * 6.0
    c = torch.randn(sites, 1, m, generator=g, dtype=dtype)
    return quad, c, grid, child


@pytest.mark.parametrize("name", CASES)
def test_the_e_step_kernels_match_the_equation(name: str) -> None:
    quad, c, grid, child = _case(name)
    q1, c1 = quad.clone().requires_grad_(), c.clone().requires_grad_()
    r = triton_e_step(q1, c1, grid)
    q2, c2 = quad.clone().requires_grad_(), c.clone().requires_grad_()
    want = e_step_equation(q2, c2, child)
    torch.testing.assert_close(r, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(q1.detach(), quad)  # the input is left as it is
    g = torch.randn(r.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    got = torch.autograd.grad(r, (q1, c1), g)
    ref = torch.autograd.grad(want, (q2, c2), g)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["conv-3x3", "fc"])
def test_the_e_step_kernels_match_the_torch_code_in_float32(name: str) -> None:
    quad, c, grid, _ = _case(name, torch.float32)
    q1, c1 = quad.clone().requires_grad_(), c.clone().requires_grad_()
    r = triton_e_step(q1, c1, grid)
    q2, c2 = quad.clone().requires_grad_(), c.clone().requires_grad_()
    want = EStep.apply(q2.clone(), c2, grid)
    torch.testing.assert_close(r, want, rtol=1e-5, atol=1e-7)
    g = torch.randn(r.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad(r, (q1, c1), g)
    for a, b in zip(got, torch.autograd.grad(want, (q2, c2), g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_e_step_ops_have_fake_implementations() -> None:
    from capsctl.layers.backend.triton import estep_ops  # noqa: F401  (registers the ops)

    quad, c, _, _ = _case("fc", torch.float32)
    cb = c[:, 0]
    ops = torch.ops.capsctl
    torch.library.opcheck(ops.triton_estep_softmax.default, (quad, cb))
    zmax, esum = ops.triton_estep_stats(quad, cb)
    torch.library.opcheck(ops.triton_estep_stats.default, (quad, cb))
    torch.library.opcheck(ops.triton_estep_apply.default, (quad, cb, zmax, esum))
    r, g = ops.triton_estep_softmax(quad, cb), torch.randn_like(quad)
    torch.library.opcheck(ops.triton_estep_rowdot.default, (r, g))
    torch.library.opcheck(ops.triton_estep_backward.default, (r, g, zmax, True))


def test_em_routing_runs_its_e_step_as_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from capsctl.config import build_model
    from capsctl.layers.backend.triton import aot as gpu_aot
    from capsctl.layers.routers.em import windows
    from capsctl.layers.routers.em.fused import keeping_assignments

    def no_torch_e_step(*args: object) -> None:
        raise AssertionError("the torch E-step ran where the Triton kernels run")

    monkeypatch.setattr(windows.EStep, "apply", no_torch_e_step)
    torch.manual_seed(0)
    tiny = {"primary_types": 2, "primary_dim": 4, "input_size": 8, "num_classes": 2}
    layers = [{"kind": "conv", "types": 2, "pose_dim": 4, "kernel": 3, "stride": 1}]
    net = build_model({"base": "cifar10-em-simple", **tiny, "layers": layers}).train()
    # the launches are recorded, not run: the values are not looked at. A training step fuses
    # each E-step into the next M-step's moments (capsctl/layers/backend/triton/em_estep.py),
    # two in each of the two layers at T=3, and takes the first M-step's uniform assignments
    # through the same kernels; with the assignments kept (a routing trace) the E-step's own
    # kernels run
    with gpu_aot.capturing() as launches:
        net(torch.randn(2, 3, 8, 8)).sum().backward()
    kernels = [launch.kernel for launch in launches]
    assert kernels.count("em_estep_stats") == 4 and kernels.count("em_estep_moments") == 6
    assert "em_estep_input_grad" in kernels and "estep_forward" not in kernels, kernels
    assert "em_forward" not in kernels, kernels  # no assignment-sized tensor read
    with gpu_aot.capturing() as launches, keeping_assignments():
        net(torch.randn(2, 3, 8, 8)).sum().backward()
    kernels = [launch.kernel for launch in launches]
    assert kernels.count("estep_forward") >= 3 and "estep_backward" in kernels, kernels
    assert "em_estep_stats" not in kernels, kernels


def test_a_failing_e_step_kernel_falls_back_to_the_torch_code(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Failing:
        def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
            def launch(*args: object, **kwargs: object) -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            return launch

    monkeypatch.setattr(dispatch, "_FUSED_FAILED", {})
    monkeypatch.setattr(dispatch, "_FUSED_PROVEN", set())
    monkeypatch.setattr(estep_kernels, "estep_backward", Failing())
    quad, c, grid, _ = _case("conv-3x3", torch.float32)
    q1, c1 = quad.clone().requires_grad_(), c.clone().requires_grad_()
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        r = e_step(q1 * 1.0, c1, grid)
        got = torch.autograd.grad(r, (q1, c1), torch.ones_like(r))
    q2, c2 = quad.clone().requires_grad_(), c.clone().requires_grad_()
    want = EStep.apply(q2 * 1.0, c2, grid)
    torch.testing.assert_close(r, want)
    torch.testing.assert_close(got, torch.autograd.grad(want, (q2, c2), torch.ones_like(want)))
    messages = [m.getMessage() for m in caplog.records if m.levelno == logging.WARNING]
    assert len(messages) == 1 and "e_step pass" in messages[0], messages
