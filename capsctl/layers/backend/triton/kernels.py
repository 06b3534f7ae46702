"""Triton kernels of the routed and the weighted pass: the votes built on chip, never stored.

Letters and layouts as in capsctl/layers/passes/routed.py: child poses ``x[J, B, a, x]``,
weights ``w[J, x, m, c]``, parent poses ``p[B, m, a, c]``, coefficients ``r[J, B, m]``, the sum
``s[B, m, a, c]`` (all contiguous). A program owns a tile of ``BJ`` children and a span of
``SB`` parent sites; per site it builds the tile's votes ``V[BJ, m, a, c]`` as ``XD`` rank-one
updates (the child pose column times the weight row), then

- routed (``ROUTED``): ``A = scale * sum_{a,c} V P``, ``R = softmax_m(A)`` (stored),
  ``S += sum_j R V``;
- weighted: ``R`` read, ``S += sum_j R V``.

The backward rebuilds the tile's votes site by site. From ``G = d loss / d S``:
``dR = sum_{a,c} V G``; routed: ``dA = R (dR - sum_m R dR)``, ``dP += scale sum_j dA V``,
``dV = R G + scale dA P``; weighted: ``dR`` stored, ``dV = R G``; then ``dX = dV W^T`` (stored:
one site, one child) and ``dW = X^T dV`` (summed over the program's sites on chip, then added).
Sums across programs (``S``, ``dP`` over child tiles, ``dW`` over site spans) are atomic adds
into zeroed buffers. Block edges (``BM``, ``BA``, ``BC``, ``BX``: powers of two at least ``m``,
``a``, ``c``, ``x``) are masked; padded entries load as zero. ``ACC`` is the accumulation type
(float32; float64 for float64 inputs).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "add_site",
    "coef_offs",
    "load_site",
    "pass_backward",
    "pass_forward",
    "tile_index",
    "votes",
    "w_row",
    "x_col",
]


@triton.jit
def tile_index(j0, BJ: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr):
    """Index blocks ``jj[BJ,1,1,1]``, ``mm[1,BM,1,1]``, ``aa[1,1,BA,1]``, ``cc[1,1,1,BC]``."""
    jj = (j0 + tl.arange(0, BJ)).to(tl.int64)[:, None, None, None]
    mm = tl.arange(0, BM)[None, :, None, None]
    aa = tl.arange(0, BA)[None, None, :, None]
    cc = tl.arange(0, BC)[None, None, None, :]
    return jj, mm, aa, cc


@triton.jit
def x_col(x_ptr, b, xi, jj, aa, J, B, A, XD: tl.constexpr, ACC: tl.constexpr):
    """Column ``xi`` of the child poses at site ``b``: ``X[j, b, a, xi]`` -> ``[BJ, 1, BA, 1]``."""
    offs = ((jj * B + b) * A + aa) * XD + xi
    return tl.load(x_ptr + offs, mask=(jj < J) & (aa < A), other=0.0).to(ACC)


@triton.jit
def w_row(w_ptr, xi, jj, mm, cc, J, M, C, XD: tl.constexpr, ACC: tl.constexpr):
    """Row ``xi`` of the weights: ``W[j, xi, m, c]`` -> ``[BJ, BM, 1, BC]``."""
    offs = ((jj * XD + xi) * M + mm) * C + cc
    return tl.load(w_ptr + offs, mask=(jj < J) & (mm < M) & (cc < C), other=0.0).to(ACC)


@triton.jit
def votes(x_ptr, w_ptr, b, jj, mm, aa, cc, J, B, M, A, C, XD: tl.constexpr, ACC: tl.constexpr):
    """``V[j, m, a, c] = sum_x X[j, b, a, x] W[j, x, m, c]`` of one site -> ``[BJ, BM, BA, BC]``."""
    v = x_col(x_ptr, b, 0, jj, aa, J, B, A, XD, ACC) * w_row(w_ptr, 0, jj, mm, cc, J, M, C, XD, ACC)
    for xi in tl.static_range(1, XD):
        xv = x_col(x_ptr, b, xi, jj, aa, J, B, A, XD, ACC)  # [BJ, 1, BA, 1]
        v += xv * w_row(w_ptr, xi, jj, mm, cc, J, M, C, XD, ACC)  # [BJ, BM, BA, BC]
    return v


@triton.jit
def load_site(ptr, b, mm, aa, cc, M, A, C, ACC: tl.constexpr):
    """A parent-sized operand at site ``b``: ``T[b, m, a, c]`` -> ``[1, BM, BA, BC]``."""
    offs = ((b * M + mm) * A + aa) * C + cc
    return tl.load(ptr + offs, mask=(mm < M) & (aa < A) & (cc < C), other=0.0).to(ACC)


@triton.jit
def add_site(ptr, b, part, M, A, C, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr):
    """Atomically add ``part[BM, BA, BC]`` to ``T[b, m, a, c]``."""
    m3 = tl.arange(0, BM)[:, None, None]
    a3 = tl.arange(0, BA)[None, :, None]
    c3 = tl.arange(0, BC)[None, None, :]
    offs = ((b * M + m3) * A + a3) * C + c3
    tl.atomic_add(ptr + offs, part, mask=(m3 < M) & (a3 < A) & (c3 < C))


@triton.jit
def coef_offs(j0, b, B, M, BJ: tl.constexpr, BM: tl.constexpr):
    """Offsets ``[BJ, BM]`` into a coefficient-sized ``T[J, B, m]`` at site ``b``, and ``m``."""
    j2 = (j0 + tl.arange(0, BJ)).to(tl.int64)[:, None]
    m2 = tl.arange(0, BM)[None, :]
    return (j2 * B + b) * M + m2, j2, m2


@triton.jit
def pass_forward(
    x_ptr, w_ptr, p_ptr, r_ptr, s_ptr, J, B, M, A, C, SB, scale,
    XD: tl.constexpr, ROUTED: tl.constexpr, ACC: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """``S[B, m, a, c] += sum_j R V`` over one child tile and a span of sites; ``ROUTED``: ``R``
    from the agreement with ``P`` (written to ``r_ptr``), else read from ``r_ptr``."""
    j0 = tl.program_id(0) * BJ
    b_lo = tl.program_id(1) * SB
    jj, mm, aa, cc = tile_index(j0, BJ, BM, BA, BC)
    for b in range(b_lo, tl.minimum(b_lo + SB, B)):
        v = votes(x_ptr, w_ptr, b, jj, mm, aa, cc, J, B, M, A, C, XD, ACC)  # [BJ, BM, BA, BC]
        roffs, j2, m2 = coef_offs(j0, b, B, M, BJ, BM)  # [BJ, BM]
        rmask = (j2 < J) & (m2 < M)
        if ROUTED:
            pv = load_site(p_ptr, b, mm, aa, cc, M, A, C, ACC)  # [1, BM, BA, BC]
            logit = tl.sum(tl.sum(v * pv, axis=3), axis=2) * scale  # [BJ, BM]
            logit = tl.where(m2 < M, logit, float("-inf"))
            e = tl.exp(logit - tl.max(logit, axis=1)[:, None])  # [BJ, BM]
            r = e / tl.sum(e, axis=1)[:, None]  # [BJ, BM]
            tl.store(r_ptr + roffs, r, mask=rmask)
        else:
            r = tl.load(r_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BJ, BM]
        part = tl.sum(r[:, :, None, None] * v, axis=0)  # [BM, BA, BC]
        add_site(s_ptr, b, part, M, A, C, BM, BA, BC)


@triton.jit
def pass_backward(
    x_ptr, w_ptr, p_ptr, r_ptr, g_ptr, gx_ptr, gw_ptr, gp_ptr, J, B, M, A, C, SB, scale,
    XD: tl.constexpr, ROUTED: tl.constexpr, ACC: tl.constexpr,
    NEED_X: tl.constexpr, NEED_W: tl.constexpr, NEED_P: tl.constexpr,
    BJ: tl.constexpr, BM: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr, BX: tl.constexpr,
):  # fmt: skip
    """Gradients of one child tile over a span of sites from ``G[B, m, a, c]`` (``g_ptr``):
    ``dX[J, B, a, x]`` stored, ``dW[J, x, m, c]`` added once per program; ``dP[B, m, a, c]``
    added per site (routed) or ``dR[J, B, m]`` stored in ``gp_ptr`` (weighted)."""
    j0 = tl.program_id(0) * BJ
    b_lo = tl.program_id(1) * SB
    jj, mm, aa, cc = tile_index(j0, BJ, BM, BA, BC)
    xs = tl.arange(0, BX)[None, None, None, :]  # [1, 1, 1, BX]
    gw = tl.zeros((BJ, BM, BC, BX), dtype=ACC)  # dW of the tile, [j, m, c, x]
    for b in range(b_lo, tl.minimum(b_lo + SB, B)):
        v = votes(x_ptr, w_ptr, b, jj, mm, aa, cc, J, B, M, A, C, XD, ACC)  # [BJ, BM, BA, BC]
        gv = load_site(g_ptr, b, mm, aa, cc, M, A, C, ACC)  # [1, BM, BA, BC]
        roffs, j2, m2 = coef_offs(j0, b, B, M, BJ, BM)  # [BJ, BM]
        rmask = (j2 < J) & (m2 < M)
        r = tl.load(r_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BJ, BM]
        dr = tl.sum(tl.sum(v * gv, axis=3), axis=2)  # [BJ, BM]
        dv = r[:, :, None, None] * gv  # [BJ, BM, BA, BC]
        if ROUTED:
            da = r * (dr - tl.sum(r * dr, axis=1)[:, None])  # [BJ, BM], before the scale
            if NEED_P:
                part = tl.sum(da[:, :, None, None] * v, axis=0) * scale  # [BM, BA, BC]
                add_site(gp_ptr, b, part, M, A, C, BM, BA, BC)
            pv = load_site(p_ptr, b, mm, aa, cc, M, A, C, ACC)  # [1, BM, BA, BC]
            dv += (scale * da)[:, :, None, None] * pv  # [BJ, BM, BA, BC]
        elif NEED_P:
            tl.store(gp_ptr + roffs, dr, mask=rmask)  # dR[J, B, m]
        for xi in tl.static_range(XD):
            if NEED_X:
                wv = w_row(w_ptr, xi, jj, mm, cc, J, M, C, XD, ACC)  # [BJ, BM, 1, BC]
                gxi = tl.sum(tl.sum(dv * wv, axis=3), axis=1)  # [BJ, BA]
                a2 = tl.arange(0, BA)[None, :]
                offs = ((j2 * B + b) * A + a2) * XD + xi  # [BJ, BA]
                tl.store(gx_ptr + offs, gxi, mask=(j2 < J) & (a2 < A))
            if NEED_W:
                xv = x_col(x_ptr, b, xi, jj, aa, J, B, A, XD, ACC)  # [BJ, 1, BA, 1]
                gwi = tl.sum(xv * dv, axis=2)  # [BJ, BM, BC]
                gw += tl.where(xs == xi, gwi[:, :, :, None], 0.0)  # [BJ, BM, BC, BX]
    if NEED_W:
        c4 = tl.arange(0, BC)[None, None, :, None]
        m4 = tl.arange(0, BM)[None, :, None, None]
        offs = ((jj * XD + xs) * M + m4) * C + c4  # [BJ, BM, BC, BX] into W[J, x, m, c]
        tl.atomic_add(gw_ptr + offs, gw, mask=(jj < J) & (m4 < M) & (c4 < C) & (xs < XD))
