"""EM routing's Triton passes (capsctl/layers/backend/triton/em.py), under Triton's interpreter.

The M-step's moments ``sum_J r a U``, ``sum_J r a U^2`` and mass ``sum_J r a``, and the
E-step's quadratic form ``sum_d (q U + p U^2)``, with ``U = X W - shift`` (Hinton, Sabour,
Frosst, ICLR 2018), values and every gradient, against the equations as einsums in float64,
against capsctl/layers/passes/em_moments.py (VoteMoments, VoteQuad; their layouts converted
here), and by gradcheck; matrix and vector poses, one parent, one child, partial tiles.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend.triton.em_ops import triton_em_moments, triton_em_quad  # noqa: E402
from capsctl.layers.passes.em_moments import VoteMoments, VoteQuad  # noqa: E402

F64 = torch.float64

# (J, B, a, x, m, c, block_j, sites per program); 0: the default launch shape
SHAPES = {
    "matrix-partial-tiles": (5, 3, 4, 4, 3, 4, 2, 2),
    "vector-odd-dims": (7, 2, 1, 6, 5, 3, 4, 1),
    "one-parent": (4, 2, 4, 4, 1, 4, 0, 0),
    "one-child": (1, 3, 4, 4, 3, 4, 0, 2),
}


def _inputs(shape: tuple[int, ...], dtype: torch.dtype = F64, seed: int = 0):
    """``r[B, J, m]``, ``act[B, J]``, ``x[J, B, a, x]``, ``w[J, x, m, c]``, and ``shift``,
    ``q``, ``p`` ``[B, m, a, c]``."""
    j, bsz, a, xd, m, c = shape[:6]
    g = torch.Generator().manual_seed(seed)
    r = torch.softmax(torch.randn(bsz, j, m, generator=g, dtype=dtype), -1)
    act = torch.rand(bsz, j, generator=g, dtype=dtype)
    x = torch.randn(j, bsz, a, xd, generator=g, dtype=dtype)
    w = torch.randn(j, xd, m, c, generator=g, dtype=dtype) / xd**0.5
    shift, q, p = (torch.randn(bsz, m, a, c, generator=g, dtype=dtype) for _ in range(3))
    return r, act, x, w, shift, q, p


def shifted_votes(x, w, shift):  # type: ignore[no-untyped-def]
    """``U = X W - shift`` -> ``[B, J, m, a, c]``."""
    return torch.einsum("jbax,jxmc->bjmac", x, w) - shift[:, None]  # [B, J, m, a, c]


def moments_equations(r, act, x, w, shift):  # type: ignore[no-untyped-def]
    u = shifted_votes(x, w, shift)  # [B, J, m, a, c]
    k = r * act[:, :, None]  # [B, J, m]
    s1 = torch.einsum("bjm,bjmac->bmac", k, u)  # [B, m, a, c]
    return s1, torch.einsum("bjm,bjmac->bmac", k, u * u), k.sum(1)  # ..., [B, m]


def quad_equations(q, p, x, w, shift):  # type: ignore[no-untyped-def]
    u = shifted_votes(x, w, shift)  # [B, J, m, a, c]
    return torch.einsum("bjmac,bmac->bjm", u, q) + torch.einsum("bjmac,bmac->bjm", u * u, p)


def _leaves(*ts: torch.Tensor):  # type: ignore[no-untyped-def]
    return [t.clone().requires_grad_() for t in ts]


def _loss(outs, seed: int = 1):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)


def _site_major(t: torch.Tensor) -> torch.Tensor:
    """``[B, m, a, c]`` -> em_moments.py's ``[B, d, m]`` (``d = (a, c)``)."""
    return t.permute(0, 2, 3, 1).reshape(t.shape[0], -1, t.shape[1])  # [B, a*c, m]


def _parent_major(t: torch.Tensor, a: int, c: int) -> torch.Tensor:
    """``[B, d, m]`` -> ``[B, m, a, c]``."""
    return t.view(t.shape[0], a, c, t.shape[2]).permute(0, 3, 1, 2)  # [B, m, a, c]


def _wc(w: torch.Tensor) -> torch.Tensor:
    """``w[J, x, m, c]`` -> em_moments.py's ``wc[J, x, c*m]`` (parent type innermost)."""
    return w.permute(0, 1, 3, 2).reshape(w.shape[0], w.shape[1], -1)  # [J, x, c*m]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_moments_and_quadratic_form_match_the_equations_in_float64(shape) -> None:  # type: ignore[no-untyped-def]
    r, act, x, w, shift, q, p = _inputs(shape)
    tiles = {"block_j": shape[6], "sites": shape[7]}
    for op, ref, ins in (
        (triton_em_moments, moments_equations, (r, act, x, w)),
        (triton_em_quad, quad_equations, (q, p, x, w)),
    ):
        got_in, ref_in = _leaves(*ins), _leaves(*ins)
        out, want = op(*got_in, shift, **tiles), ref(*ref_in, shift)
        out, want = (out, want) if isinstance(out, tuple) else ((out,), (want,))
        for got, ref_out in zip(out, want, strict=True):
            torch.testing.assert_close(got, ref_out, rtol=1e-10, atol=1e-12)
        grads = torch.autograd.grad(_loss(out), got_in)
        for got, ref_g in zip(grads, torch.autograd.grad(_loss(want), ref_in), strict=True):
            torch.testing.assert_close(got, ref_g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_float32_em_passes_match_vote_moments_and_vote_quad(shape) -> None:  # type: ignore[no-untyped-def]
    r, act, x, w, shift, q, p = _inputs(shape, dtype=torch.float32, seed=2)
    a, c = x.shape[2], w.shape[3]
    tiles = {"block_j": shape[6], "sites": shape[7]}
    tol = {"rtol": 1e-4, "atol": 1e-5}
    got_in = _leaves(r, act, x, w)
    s1, s2, mass = triton_em_moments(*got_in, shift, **tiles)
    ref_in = _leaves(r, act, x, w)
    g1, g2, gm = (torch.randn_like(t) for t in (s1, s2, mass))
    got = torch.autograd.grad((s1 * g1).sum() + (s2 * g2).sum() + (mass * gm).sum(), got_in)
    with dispatch.use("chunked", sites=2):  # the torch code, forward and backward
        out, mass_ref = VoteMoments.apply(*ref_in[:3], _wc(ref_in[3]), _site_major(shift))
        gs = torch.stack((_site_major(g1), _site_major(g2)))  # [2, B, d, m]
        loss = (out * gs).sum() + (mass_ref.squeeze(-1) * gm).sum()
        want_g = torch.autograd.grad(loss, ref_in)
    torch.testing.assert_close(s1, _parent_major(out[0], a, c), **tol)
    torch.testing.assert_close(s2, _parent_major(out[1], a, c), **tol)
    torch.testing.assert_close(mass, mass_ref.squeeze(-1), **tol)
    for g, want in zip(got, want_g, strict=True):
        torch.testing.assert_close(g, want, **tol)
    got_in = _leaves(q, p, x, w)
    quad = triton_em_quad(*got_in, shift, **tiles)
    ref_in = _leaves(q, p, x, w)
    gq = torch.randn_like(quad)
    got = torch.autograd.grad(quad, got_in, gq)
    with dispatch.use("chunked", sites=2):
        qp = torch.stack((_site_major(ref_in[0]), _site_major(ref_in[1])))  # [2, B, d, m]
        want = VoteQuad.apply(qp, ref_in[2], _wc(ref_in[3]), _site_major(shift))  # [B, J, m]
        want_g = torch.autograd.grad(want, ref_in, gq)
    torch.testing.assert_close(quad, want, **tol)
    for g, ref_g in zip(got, want_g, strict=True):
        torch.testing.assert_close(g, ref_g, **tol)


def test_em_passes_pass_gradcheck_and_opcheck() -> None:
    shape = SHAPES["matrix-partial-tiles"]
    r, act, x, w, shift, q, p = _inputs(shape, seed=3)
    assert torch.autograd.gradcheck(
        lambda *t: triton_em_moments(*t, shift, block_j=2, sites=2), _leaves(r, act, x, w),
        fast_mode=True,
    )  # fmt: skip
    assert torch.autograd.gradcheck(
        lambda *t: triton_em_quad(*t, shift, block_j=2, sites=2), _leaves(q, p, x, w),
        fast_mode=True,
    )  # fmt: skip
    r, act, x, w, shift, q, p = _inputs(SHAPES["one-child"], dtype=torch.float32)
    ops = torch.ops.capsctl
    torch.library.opcheck(ops.triton_em_moments.default, (*_leaves(r, act, x, w), shift, [0, 0]))
    torch.library.opcheck(ops.triton_em_quad.default, (*_leaves(q, p, x, w), shift, [0, 0]))
