"""Triton kernels of EM routing's vote-sized work (capsctl/layers/passes/em_moments.py), fused.

Layouts of kernels.py (``x[J, B, a, x]``, ``w[J, x, m, c]``, parent-sized ``[B, m, a, c]``),
assignments ``r[B, J, m]``, activations ``act[B, J]``, the shift ``s[B, m, a, c]``; per site
the tile's shifted votes ``U = V - s`` and ``U^2`` are built on chip and never stored.

- Moments (``QUAD`` false): ``k = r act``; ``S1 += sum_j k U``, ``S2 += sum_j k U^2``,
  ``mass += sum_j k``. Backward from ``gS1, gS2, gmass``: ``g = sum_{a,c} (gS1 U + gS2 U^2)
  + gmass``, ``dr = g act``, ``dact = sum_m g r``, ``dV = k (gS1 + 2 U gS2)``.
- Quadratic form (``QUAD``): ``Q[b, j, m] = sum_{a,c} (q U + p U^2)``. Backward from ``gQ``:
  ``dq += sum_j gQ U``, ``dp += sum_j gQ U^2``, ``dV = gQ (q + 2 U p)``.

Both then take ``dX = dV W^T`` (stored) and ``dW = X^T dV`` (summed on chip, added once).
"""

from __future__ import annotations

import triton
import triton.language as tl

from capsctl.layers.backend.triton.rank_one import (
    add_site,
    load_site,
    tile_index,
    votes,
    w_row,
    x_col,
)

__all__ = ["em_backward", "em_forward"]


@triton.jit
def _pair_offs(j0, b, J, M, BJ: tl.constexpr, BM: tl.constexpr):
    """Offsets ``[BJ, BM]`` into ``T[B, J, m]`` at site ``b`` (and ``j2[BJ, 1]``, ``m2``)."""
    j2 = (j0 + tl.arange(0, BJ)).to(tl.int64)[:, None]
    m2 = tl.arange(0, BM)[None, :]
    return (b * J + j2) * M + m2, j2, m2


@triton.jit
def em_forward(
    x_ptr, w_ptr, s_ptr, k_ptr, act_ptr, q_ptr, p_ptr, o1_ptr, o2_ptr, mass_ptr,
    J, B, M, A, C, SB, XD: tl.constexpr, QUAD: tl.constexpr, ACC: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """Moments: ``o1, o2[B, m, a, c] += sum_j k U, k U^2``, ``mass[B, m] += sum_j k`` with
    ``k = r act`` (``k_ptr``: ``r``); quadratic form: ``o1[B, J, m] = sum (q U + p U^2)``."""
    j0 = tl.program_id(0) * BJ
    b_lo = tl.program_id(1) * SB
    jj, mm, aa, cc = tile_index(j0, BJ, BM, BA, BC)
    for b in range(b_lo, tl.minimum(b_lo + SB, B)):
        u = votes(x_ptr, w_ptr, b, jj, mm, aa, cc, J, B, M, A, C, XD, ACC)  # [BJ, BM, BA, BC]
        u -= load_site(s_ptr, b, mm, aa, cc, M, A, C, ACC)
        offs, j2, m2 = _pair_offs(j0, b, J, M, BJ, BM)  # [BJ, BM]
        pmask = (j2 < J) & (m2 < M)
        if QUAD:
            qv = load_site(q_ptr, b, mm, aa, cc, M, A, C, ACC)  # [1, BM, BA, BC]
            pv = load_site(p_ptr, b, mm, aa, cc, M, A, C, ACC)
            quad = tl.sum(tl.sum(u * (qv + pv * u), axis=3), axis=2)  # [BJ, BM]
            tl.store(o1_ptr + offs, quad, mask=pmask)
        else:
            act = tl.load(act_ptr + b * J + j2, mask=j2 < J, other=0.0).to(ACC)  # [BJ, 1]
            k = tl.load(k_ptr + offs, mask=pmask, other=0.0).to(ACC) * act  # [BJ, BM]
            k4 = k[:, :, None, None]
            add_site(o1_ptr, b, tl.sum(k4 * u, axis=0), M, A, C, BM, BA, BC)
            add_site(o2_ptr, b, tl.sum(k4 * u * u, axis=0), M, A, C, BM, BA, BC)
            m1 = tl.arange(0, BM)
            tl.atomic_add(mass_ptr + b * M + m1, tl.sum(k, axis=0), mask=m1 < M, sem="relaxed")


@triton.jit
def em_backward(
    x_ptr, w_ptr, s_ptr, k_ptr, act_ptr, g1_ptr, g2_ptr, gm_ptr,
    gk_ptr, gact_ptr, gx_ptr, gw_ptr, J, B, M, A, C, SB,
    XD: tl.constexpr, QUAD: tl.constexpr, ACC: tl.constexpr,
    NEED_K: tl.constexpr, NEED_X: tl.constexpr, NEED_W: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr,
):  # fmt: skip
    """Moments: ``(g1, g2, gm) = (gS1, gS2, gmass)``, ``k_ptr``: ``r``; ``gk``: ``dr[B, J, m]``
    and ``gact[B, J]`` stored. Quadratic form: ``(g1, g2) = (q, p)``, ``k_ptr``: ``gQ``;
    ``gk``, ``gact``: ``dq``, ``dp[B, m, a, c]`` added. Both: ``dX`` stored, ``dW`` added."""
    j0 = tl.program_id(0) * BJ
    b_lo = tl.program_id(1) * SB
    jj, mm, aa, cc = tile_index(j0, BJ, BM, BA, BC)
    xs = tl.arange(0, BX)[None, None, None, :]  # [1, 1, 1, BX]
    gw = tl.zeros((BJ, BM, BC, BX), dtype=ACC)  # dW of the tile, [j, m, c, x]
    for b in range(b_lo, tl.minimum(b_lo + SB, B)):
        u = votes(x_ptr, w_ptr, b, jj, mm, aa, cc, J, B, M, A, C, XD, ACC)  # [BJ, BM, BA, BC]
        u -= load_site(s_ptr, b, mm, aa, cc, M, A, C, ACC)
        offs, j2, m2 = _pair_offs(j0, b, J, M, BJ, BM)  # [BJ, BM]
        pmask = (j2 < J) & (m2 < M)
        g1 = load_site(g1_ptr, b, mm, aa, cc, M, A, C, ACC)  # [1, BM, BA, BC]
        g2 = load_site(g2_ptr, b, mm, aa, cc, M, A, C, ACC)
        k = tl.load(k_ptr + offs, mask=pmask, other=0.0).to(ACC)  # [BJ, BM]: r, or gQ
        if QUAD:
            if NEED_K:
                k4 = k[:, :, None, None]
                add_site(gk_ptr, b, tl.sum(k4 * u, axis=0), M, A, C, BM, BA, BC)
                add_site(gact_ptr, b, tl.sum(k4 * u * u, axis=0), M, A, C, BM, BA, BC)
        else:
            act = tl.load(act_ptr + b * J + j2, mask=j2 < J, other=0.0).to(ACC)  # [BJ, 1]
            if NEED_K:
                gm = tl.load(gm_ptr + b * M + m2, mask=m2 < M, other=0.0).to(ACC)  # [1, BM]
                g = tl.sum(tl.sum(u * (g1 + g2 * u), axis=3), axis=2) + gm  # [BJ, BM]
                tl.store(gk_ptr + offs, g * act, mask=pmask)
                tl.store(gact_ptr + b * J + j2, tl.sum(g * k, axis=1)[:, None], mask=j2 < J)
            k = k * act  # [BJ, BM]: r act
        dv = k[:, :, None, None] * (g1 + 2.0 * u * g2)  # [BJ, BM, BA, BC]
        for xi in tl.static_range(XD):
            if NEED_X:
                wv = w_row(w_ptr, xi, jj, mm, cc, J, M, C, XD, ACC)  # [BJ, BM, 1, BC]
                gxi = tl.sum(tl.sum(dv * wv, axis=3), axis=1)  # [BJ, BA]
                a2 = tl.arange(0, BA)[None, :]
                xoffs = ((j2 * B + b) * A + a2) * XD + xi  # [BJ, BA]
                tl.store(gx_ptr + xoffs, gxi, mask=(j2 < J) & (a2 < A))
            if NEED_W:
                xv = x_col(x_ptr, b, xi, jj, aa, J, B, A, XD, ACC)  # [BJ, 1, BA, 1]
                gw += tl.where(xs == xi, tl.sum(xv * dv, axis=2)[:, :, :, None], 0.0)
    if NEED_W:
        c4 = tl.arange(0, BC)[None, None, :, None]
        woffs = ((jj * XD + xs) * M + mm) * C + c4  # [BJ, BM, BC, BX] into W[J, x, m, c]
        tl.atomic_add(
            gw_ptr + woffs, gw, mask=(jj < J) & (mm < M) & (c4 < C) & (xs < XD), sem="relaxed"
        )
