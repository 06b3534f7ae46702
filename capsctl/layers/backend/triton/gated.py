"""Triton kernels of self-routing's gated pass (capsctl/layers/passes/gated.py), fused.

Per parent site ``b`` and child ``j`` (layouts of kernels.py, plus activations ``act[B, J]``,
routing weights ``wr[J, a*x, m]`` and biases ``br[J, m]``): the logits
``L = br + sum_{a,x} X wr``, the coefficients ``c = softmax_m(L)`` (stored), the mass
``q = c act``; per site ``S[b, m, a, c] += sum_j q V`` and ``T[b, m] += sum_j q``. The logits,
the mass and the votes never leave the chip.

Backward from ``gS[B, m, a, c]`` and ``gT[B, m]``: ``dq = sum_{a,c} V gS + gT``;
``dV = q gS`` (``dX = dV W^T``, ``dW = X^T dV`` as in kernels.py); ``dact = sum_m dq c``;
``dL = c (dq act - sum_m c dq act)``; ``dX += dL wr^T``, ``dwr = X^T dL``, ``dbr = sum_b dL``
(the weight gradients summed over the program's sites on chip, then added atomically).
"""

from __future__ import annotations

import triton
import triton.language as tl

from capsctl.layers.backend.triton.rank_one import (
    add_site,
    coef_offs,
    tile_index,
    votes,
    w_row,
    x_col,
)

__all__ = ["gated_backward", "gated_forward"]


@triton.jit
def _logits(x_ptr, wr_ptr, br_ptr, b, jj, mm, aa, j2, m2, J, B, M, A,
            XD: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``L[j, m] = br[j, m] + sum_{a,x} X[j, b, a, x] wr[j, a*x, m]`` -> ``[BJ, BM]``
    (``jj, mm, aa``: the tile's index blocks; ``j2[BJ, 1]``, ``m2[1, BM]``)."""
    logit = tl.load(br_ptr + j2 * M + m2, mask=(j2 < J) & (m2 < M), other=0.0).to(ACC)
    for xi in tl.static_range(XD):
        xv = x_col(x_ptr, b, xi, jj, aa, J, B, A, XD, ACC)  # [BJ, 1, BA, 1]
        offs = ((jj * A + aa) * XD + xi) * M + mm  # [BJ, BM, BA, 1] into wr[J, a*x, m]
        wrv = tl.load(wr_ptr + offs, mask=(jj < J) & (mm < M) & (aa < A), other=0.0).to(ACC)
        logit += tl.sum(tl.sum(xv * wrv, axis=3), axis=2)  # [BJ, BM]
    return logit


@triton.jit
def gated_forward(
    act_ptr, x_ptr, w_ptr, wr_ptr, br_ptr, coef_ptr, s_ptr, t_ptr, J, B, M, A, C, SB,
    XD: tl.constexpr, ACC: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """``S[B, m, a, c] += sum_j q V``, ``T[B, m] += sum_j q`` and ``c[J, B, m]`` stored, over
    one child tile and a span of sites."""
    j0 = tl.program_id(0) * BJ
    b_lo = tl.program_id(1) * SB
    jj, mm, aa, cc = tile_index(j0, BJ, BM, BA, BC)
    for b in range(b_lo, tl.minimum(b_lo + SB, B)):
        roffs, j2, m2 = coef_offs(j0, b, B, M, BJ, BM)  # [BJ, BM]
        logit = _logits(x_ptr, wr_ptr, br_ptr, b, jj, mm, aa, j2, m2, J, B, M, A, XD, ACC)
        logit = tl.where(m2 < M, logit, float("-inf"))
        e = tl.exp(logit - tl.max(logit, axis=1)[:, None])  # [BJ, BM]
        coef = e / tl.sum(e, axis=1)[:, None]  # [BJ, BM]
        tl.store(coef_ptr + roffs, coef, mask=(j2 < J) & (m2 < M))
        act = tl.load(act_ptr + b * J + j2, mask=j2 < J, other=0.0).to(ACC)  # [BJ, 1]
        q = tl.where(m2 < M, coef * act, 0.0)  # [BJ, BM]
        m1 = tl.arange(0, BM)
        tl.atomic_add(t_ptr + b * M + m1, tl.sum(q, axis=0), mask=m1 < M, sem="relaxed")  # T[b, m]
        v = votes(x_ptr, w_ptr, b, jj, mm, aa, cc, J, B, M, A, C, XD, ACC)  # [BJ, BM, BA, BC]
        add_site(s_ptr, b, tl.sum(q[:, :, None, None] * v, axis=0), M, A, C, BM, BA, BC)


@triton.jit
def gated_backward(
    act_ptr, x_ptr, w_ptr, wr_ptr, coef_ptr, gs_ptr, gt_ptr,
    gact_ptr, gx_ptr, gw_ptr, gwr_ptr, gbr_ptr, J, B, M, A, C, SB,
    XD: tl.constexpr, ACC: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr,
):  # fmt: skip
    """``dact[B, J]`` and ``dX[J, B, a, x]`` stored; ``dW[J, x, m, c]``, ``dwr[J, a*x, m]`` and
    ``dbr[J, m]`` added once per program."""
    j0 = tl.program_id(0) * BJ
    b_lo = tl.program_id(1) * SB
    jj, mm, aa, cc = tile_index(j0, BJ, BM, BA, BC)
    xs = tl.arange(0, BX)[None, None, None, :]  # [1, 1, 1, BX]
    gw = tl.zeros((BJ, BM, BC, BX), dtype=ACC)  # dW of the tile, [j, m, c, x]
    gwr = tl.zeros((BJ, BM, BA, BX), dtype=ACC)  # dwr of the tile, [j, m, a, x]
    gbr = tl.zeros((BJ, BM), dtype=ACC)
    for b in range(b_lo, tl.minimum(b_lo + SB, B)):
        roffs, j2, m2 = coef_offs(j0, b, B, M, BJ, BM)  # [BJ, BM]
        cmask = (j2 < J) & (m2 < M)
        coef = tl.load(coef_ptr + roffs, mask=cmask, other=0.0).to(ACC)  # [BJ, BM]
        act = tl.load(act_ptr + b * J + j2, mask=j2 < J, other=0.0).to(ACC)  # [BJ, 1]
        v = votes(x_ptr, w_ptr, b, jj, mm, aa, cc, J, B, M, A, C, XD, ACC)  # [BJ, BM, BA, BC]
        offs = ((b * M + mm) * A + aa) * C + cc  # [1, BM, BA, BC] into gS[B, m, a, c]
        gsv = tl.load(gs_ptr + offs, mask=(mm < M) & (aa < A) & (cc < C), other=0.0).to(ACC)
        gtv = tl.load(gt_ptr + b * M + m2, mask=m2 < M, other=0.0).to(ACC)  # [1, BM]
        dq = tl.sum(tl.sum(v * gsv, axis=3), axis=2) + gtv  # [BJ, BM]
        tl.store(gact_ptr + b * J + j2, tl.sum(dq * coef, axis=1)[:, None], mask=j2 < J)
        dc = dq * act  # [BJ, BM]
        dl = coef * (dc - tl.sum(coef * dc, axis=1)[:, None])  # [BJ, BM]
        gbr += dl
        dv = (coef * act)[:, :, None, None] * gsv  # [BJ, BM, BA, BC]
        dl4 = dl[:, :, None, None]  # [BJ, BM, 1, 1]
        a2 = tl.arange(0, BA)[None, :]
        for xi in tl.static_range(XD):
            wv = w_row(w_ptr, xi, jj, mm, cc, J, M, C, XD, ACC)  # [BJ, BM, 1, BC]
            roffs4 = ((jj * A + aa) * XD + xi) * M + mm  # [BJ, BM, BA, 1] into wr[J, a*x, m]
            wrv = tl.load(wr_ptr + roffs4, mask=(jj < J) & (mm < M) & (aa < A), other=0.0)
            gxi = tl.sum(tl.sum(dv * wv, axis=3), axis=1)  # [BJ, BA]: through the votes
            gxi += tl.sum(tl.sum(dl4 * wrv.to(ACC), axis=3), axis=1)  # and the logits
            offs2 = ((j2 * B + b) * A + a2) * XD + xi  # [BJ, BA]
            tl.store(gx_ptr + offs2, gxi, mask=(j2 < J) & (a2 < A))
            xv = x_col(x_ptr, b, xi, jj, aa, J, B, A, XD, ACC)  # [BJ, 1, BA, 1]
            gw += tl.where(xs == xi, tl.sum(xv * dv, axis=2)[:, :, :, None], 0.0)
            gwr += tl.where(xs == xi, xv * dl4, 0.0)  # [BJ, BM, BA, BX]
    c4 = tl.arange(0, BC)[None, None, :, None]
    offs = ((jj * XD + xs) * M + mm) * C + c4  # [BJ, BM, BC, BX] into W[J, x, m, c]
    tl.atomic_add(gw_ptr + offs, gw, mask=(jj < J) & (mm < M) & (c4 < C) & (xs < XD), sem="relaxed")
    offs = ((jj * A + aa) * XD + xs) * M + mm  # [BJ, BM, BA, BX] into wr[J, a*x, m]
    tl.atomic_add(
        gwr_ptr + offs, gwr, mask=(jj < J) & (mm < M) & (aa < A) & (xs < XD), sem="relaxed"
    )
    j2 = (j0 + tl.arange(0, BJ))[:, None]
    m2 = tl.arange(0, BM)[None, :]
    tl.atomic_add(gbr_ptr + j2 * M + m2, gbr, mask=(j2 < J) & (m2 < M), sem="relaxed")
