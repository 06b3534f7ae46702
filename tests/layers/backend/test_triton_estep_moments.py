"""EM routing's E-step fused into the next M-step's moments (Triton kernels of
capsctl/layers/backend/triton/em_estep.py, under Triton's interpreter), the assignments never
stored: values and every gradient against the equations as einsums in float64 (Hinton, Sabour,
Frosst, ICLR 2018, Procedure 1) with the softmax over every parent a conv child votes for, and
by gradcheck.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.layers.routers.em.windows import (  # noqa: E402
    WindowGrid,
    softmax_over_parents,
    triton_e_then_moments,
)

F64 = torch.float64
# a conv layer's sites: 2 images, a 4x4 grid of 2 child types, 3x3 windows of stride 1 (2x2
# sites), so that J = 3 * 3 * 2 = 18 children at each of B = 2 * 2 * 2 = 8 sites
GRID = WindowGrid.of(torch.zeros(2, 4, 4, 2), 3, 1)  # the child activations [b, H, W, n]
# (J, B, a, x, m, c, grid)
SHAPES = {
    "conv-windows": (18, 8, 4, 4, 3, 4, GRID),
    "fc-matrix": (5, 3, 4, 4, 3, 4, None),
    "fc-vector-odd": (7, 2, 1, 6, 5, 3, None),
    "one-parent": (4, 2, 4, 4, 1, 4, None),
    # 6x6 poses and 40 parents (64 padded): the E-step's kernels take two blocks of parents a
    # block of sites, the second partial
    "parent-blocks": (3, 2, 6, 6, 40, 6, None),
}


def _inputs(shape, dtype=F64, seed=0):  # type: ignore[no-untyped-def]
    """``q, p[B, m, a, c]`` (``p > 0``: inverse variances), ``c[B, m]``, ``act[B, J]``,
    ``x[J, B, a, x]``, ``w[J, x, m, c]``, ``shift[B, m, a, c]``."""
    j, bsz, a, xd, m, c = shape[:6]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, m, a, c, generator=g, dtype=dtype)
    p = torch.rand(bsz, m, a, c, generator=g, dtype=dtype) + 0.2
    cc = torch.randn(bsz, m, generator=g, dtype=dtype)
    act = torch.rand(bsz, j, generator=g, dtype=dtype)
    x = torch.randn(j, bsz, a, xd, generator=g, dtype=dtype)
    w = torch.randn(j, xd, m, c, generator=g, dtype=dtype) / xd**0.5
    shift = torch.randn(bsz, m, a, c, generator=g, dtype=dtype) * 0.1
    return q, p, cc, act, x, w, shift


def equations(q, p, c, act, x, w, shift, grid):  # type: ignore[no-untyped-def]
    """The E-step and the moments written out: ``U = X W - shift``, ``z = c - sum_{a,c}
    (q U + p U^2) / 2``, ``R`` the softmax of ``z`` over every parent the child votes for,
    ``S1 = sum_J R act U``, ``S2 = sum_J R act U^2``, ``mass = sum_J R act``."""
    u = torch.einsum("jbax,jxmc->bjmac", x, w) - shift[:, None]  # [B, J, m, a, c]
    quad = torch.einsum("bjmac,bmac->bjm", u, q) + torch.einsum("bjmac,bmac->bjm", u * u, p)
    z = c[:, None, :] - 0.5 * quad  # [B, J, m]
    if grid is None:
        r = torch.softmax(z, dim=-1)  # [B, J, m]
    else:
        r = softmax_over_parents(z.transpose(1, 2), grid).transpose(1, 2)  # [B, J, m]
    k = r * act[:, :, None]  # [B, J, m]
    s1 = torch.einsum("bjm,bjmac->bmac", k, u)  # [B, m, a, c]
    s2 = torch.einsum("bjm,bjmac->bmac", k, u * u)  # [B, m, a, c]
    return s1, s2, k.sum(1)  # ..., [B, m]


def _moments(out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``(S[2, B, m, a, c], mass)`` -> ``(S1, S2, mass)``."""
    return (*out[0].unbind(0), out[1])


def _leaves(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone().requires_grad_() for t in ts]


def _loss(outs, seed: int = 1):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)  # the same weights for float32 and float64 outputs
    return sum((o * torch.randn(o.shape, generator=g, dtype=F64).to(o.dtype)).sum() for o in outs)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_fused_e_step_and_moments_match_the_equations_in_float64(shape) -> None:  # type: ignore[no-untyped-def]
    *ins, shift = _inputs(shape)
    grid = shape[6]
    got_in, ref_in = _leaves(*ins), _leaves(*ins)
    out = _moments(triton_e_then_moments(*got_in, shift, grid))
    want = equations(*ref_in, shift, grid)
    for got, ref in zip(out, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(_loss(out), got_in)
    for got, ref in zip(grads, torch.autograd.grad(_loss(want), ref_in), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-11)


def test_fused_e_step_and_moments_in_float32_stay_within_their_tolerance() -> None:
    """Float32 inputs (float32 sums, tf32x3 products) against the float64 equations: within
    1e-4 relative, 1e-5 absolute, as the unfused passes."""
    shape = SHAPES["conv-windows"]
    *ins, shift = _inputs(shape, seed=4)
    grid = shape[6]
    got_in = _leaves(*(t.float() for t in ins))
    out = _moments(triton_e_then_moments(*got_in, shift.float(), grid))
    ref_in = _leaves(*ins)
    want = equations(*ref_in, shift, grid)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for got, ref in zip(out, want, strict=True):
        torch.testing.assert_close(got.double(), ref, **tol)
    grads = torch.autograd.grad(_loss(out), got_in)
    for got, ref in zip(grads, torch.autograd.grad(_loss(want), ref_in), strict=True):
        torch.testing.assert_close(got.double(), ref, **tol)


@pytest.mark.parametrize("shape", [SHAPES["conv-windows"], SHAPES["fc-matrix"]], ids=["conv", "fc"])
def test_the_first_m_steps_uniform_assignments_through_the_fused_kernels(shape) -> None:  # type: ignore[no-untyped-def]
    """With the E-step's operands zero and each child's normalizer given, ``lse = log(m *
    windows)``, the kernels take the first M-step's uniform assignments ``1 / (m * windows)``
    (Procedure 1's ``1 / |Omega_{L+1}|``): the moments and the gradients of ``act``, ``x`` and
    ``w`` (the operands need none) equal the equations'."""
    _, _, _, act, x, w, shift = _inputs(shape, seed=5)
    j, bsz, m, grid = shape[0], shape[1], shape[4], shape[6]
    ones = torch.ones(bsz, j, dtype=F64)
    windows = ones if grid is None else grid.sum_overwindow_sites(ones)  # [B, J]
    lse = torch.log(m * windows)  # [B, J]
    zeros = torch.zeros(bsz, m, shape[2], shape[5], dtype=F64)
    got_in, ref_in = _leaves(act, x, w), _leaves(act, x, w)
    out = _moments(triton_e_then_moments(zeros, zeros, zeros[..., 0, 0], *got_in, shift, grid, lse))
    r = (1.0 / (m * windows))[:, :, None].expand(bsz, j, m)  # [B, J, m]
    u = torch.einsum("jbax,jxmc->bjmac", ref_in[1], ref_in[2]) - shift[:, None]
    k = r * ref_in[0][:, :, None]  # [B, J, m]
    want = (
        torch.einsum("bjm,bjmac->bmac", k, u),
        torch.einsum("bjm,bjmac->bmac", k, u * u),
        k.sum(1),
    )
    for got, ref in zip(out, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(_loss(out), got_in)
    for got, ref in zip(grads, torch.autograd.grad(_loss(want), ref_in), strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-11)


def test_fused_e_step_and_moments_pass_gradcheck_and_opcheck() -> None:
    # overlapping windows at a small size (each gradcheck evaluation is a launch under the
    # interpreter): a 3x3 grid of 2 child types, 2x2 windows of stride 1 (4 sites of 8
    # children), 2 parent types of 2x2 poses
    grid = WindowGrid.of(torch.zeros(1, 3, 3, 2), 2, 1)
    *ins, shift = _inputs((8, 4, 2, 2, 2, 2, grid), seed=3)
    assert torch.autograd.gradcheck(
        lambda *t: _moments(triton_e_then_moments(*t, shift, grid)), _leaves(*ins), fast_mode=True
    )
    q, p, c, act, x, w, shift = _inputs(SHAPES["fc-matrix"], dtype=torch.float32)
    ops = torch.ops.capsctl
    lse = torch.zeros(act.shape)
    g1, g2, gm = torch.randn_like(shift), torch.randn_like(shift), torch.randn_like(c)
    torch.library.opcheck(ops.triton_em_estep_stats.default, (q, p, c, x, w, shift, [0, 0]))
    base = (q, p, c, lse, act, x, w, shift)
    torch.library.opcheck(ops.triton_em_estep_moments.default, (*base, [0, 0]))
    torch.library.opcheck(ops.triton_em_estep_rowdot.default, (*base, g1, g2, gm, [0, 0]))
    for needs in ([True, True, True], [False, True, True], [True, False, False]):
        grads = (*base, g1, g2, gm, torch.randn_like(lse), needs, [0, 0])
        torch.library.opcheck(ops.triton_em_estep_grads.default, grads)


def test_a_routing_trace_gets_every_iterations_assignments() -> None:
    """Trained through the fused kernels, EM routing stores no assignments after its first
    iteration; a trace (``inspect-routing``) still gets all three iterations' of every layer,
    equal to the torch code's."""
    from capsctl.config import build_model
    from capsctl.layers.backend import dispatch

    torch.manual_seed(0)
    tiny = {"primary_types": 2, "primary_dim": 4, "input_size": 8, "num_classes": 2}
    layers = [{"kind": "conv", "types": 2, "pose_dim": 4, "kernel": 3, "stride": 1}]
    net = build_model({"base": "cifar10-em-simple", **tiny, "layers": layers}).eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with dispatch.use("triton"):
            dispatch.reset_ran()
            out, trace = net(x, trace=True)
            assert dispatch.fused_ran().get("e_step", 0) == 4, dispatch.fused_ran()
            plain = net(x)
            # three M-steps in each of two layers, the first with the uniform assignments
            assert dispatch.fused_ran().get("em_estep_moments", 0) == 6, dispatch.fused_ran()
        with dispatch.use("chunked"):
            want, want_trace = net(x, trace=True)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(plain, want, rtol=1e-4, atol=1e-5)
    assert [len(c) for c in trace.coefficients] == [3, 3]
    for got, ref in zip(trace.coefficients, want_trace.coefficients, strict=True):
        for r, r_ref in zip(got, ref, strict=True):
            torch.testing.assert_close(r, r_ref, rtol=1e-4, atol=1e-5)
