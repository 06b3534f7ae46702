"""Triton kernels of EM routing's vote-sized work (capsctl/layers/passes/em_moments.py), fused.

Layouts of kernels.py and tiles.py (``x[J, B, a, x]``, ``w[J, x, m, c]``, parent-sized
``[B, m, a, c]``), assignments ``r[B, J, m]``, activations ``act[B, J]``, the shift
``s[B, m, a, c]``. As in kernels.py, a program owns ``BB`` parent sites and loops over its span
of ``JN`` children; a child's votes at the block are one ``tl.dot`` (tiles.py), shifted
``U = V - s`` on chip and never stored; every sum stays in registers and is written once per
span (the launcher adds the spans). No atomics.

- :func:`em_forward`. Moments (``QUAD`` false): ``k = r act``; ``S1 = sum_j k U``,
  ``S2 = sum_j k U^2``, ``mass = sum_j k``. Quadratic form (``QUAD``):
  ``Q[b, j, m] = sum_{a,c} (q U + p U^2)`` (stored).
- :func:`em_backward` (same grid), the coefficients' gradients. Moments, from
  ``gS1, gS2, gmass``: ``g = sum_{a,c} (gS1 U + gS2 U^2) + gmass``, ``dr = g act`` and
  ``dact = sum_m g r`` (stored). Quadratic form, from ``gQ``: ``dq = sum_j gQ U``,
  ``dp = sum_j gQ U^2`` (per span).
- :func:`em_input_grad` (same grid): ``dV = k (gS1 + 2 U gS2)`` (moments) or
  ``gQ (q + 2 U p)`` (quadratic form) needs the votes again; per child and block of ``MB``
  parents, the block's votes and ``dX += dV W^T`` are two ``tl.dot``, ``dX`` stored.
- :func:`em_weight_grad` (grid: children x site spans x parent blocks, as kernels.py's
  ``pass_weight_grad``): per block of sites, the votes of ``MB`` parents (one ``tl.dot``),
  ``dV``, and ``dW += X^T dV`` (a second), summed in registers and written once per span.
"""

from __future__ import annotations

import triton
import triton.language as tl

from capsctl.layers.backend.triton.tiles import (
    parent_tile,
    pose_rows,
    to_rows,
    vote_tile,
    weight_block,
    widen,
)

__all__ = ["em_backward", "em_forward", "em_input_grad", "em_weight_grad"]


@triton.jit
def pair_tile(j, b0, b_end, m0, J, M: tl.constexpr, I64: tl.constexpr, BB: tl.constexpr,
              MB: tl.constexpr):  # fmt: skip
    """Offsets ``[BB, MB]`` into a site-major ``T[B, J, m]`` of child ``j`` at sites
    ``b0 + [0, BB)`` and parents ``m0 + [0, MB)``, their mask (sites below ``b_end``), and the
    offsets ``[BB, 1]`` into ``act[B, J]``."""
    b2 = (b0 + tl.arange(0, BB))[:, None]
    m2 = (m0 + tl.arange(0, MB))[None, :]
    site = widen(b2, I64) * J + j  # [BB, 1]
    return site * M + m2, (b2 < b_end) & (m2 < M), site


@triton.jit
def em_forward(
    x_ptr, w_ptr, s_ptr, k_ptr, act_ptr, q_ptr, p_ptr, o1_ptr, o2_ptr, mass_ptr, J, B, JN,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr, QUAD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """Moments: ``o1, o2[span, B, m, a, c] = sum_{j in span} k U, k U^2`` and
    ``mass[span, B, m] = sum k`` with ``k = r act`` (``k_ptr``: ``r``); quadratic form:
    ``o1[B, J, m] = sum_{a,c} (q U + p U^2)``."""
    b0 = tl.program_id(0) * BB
    span = tl.program_id(1)
    j_lo = span * JN
    poffs, pmask = parent_tile(b0, B, 0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # the shift
    if QUAD:
        qv = tl.load(q_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # [BB, AP, MP, CP]
        pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    else:
        acc1 = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # S1 of the span
        acc2 = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # S2 of the span
        accm = tl.zeros((BB, MP), dtype=ACC)  # mass of the span
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_tile(x_ptr, w_ptr, j, b0, B, B, M, A, C, XD, DT, DOT, I64, BB, KP, AP,
                         MP, CP)  # fmt: skip
        u = v - sv  # [BB, AP, MP, CP]
        offs, mask, site = pair_tile(j, b0, B, 0, J, M, I64, BB, MP)  # [BB, MP]
        if QUAD:
            quad = tl.sum(tl.sum(u * (qv + pv * u), axis=3), axis=1)  # [BB, MP]
            tl.store(o1_ptr + offs, quad, mask=mask)
        else:
            act = tl.load(act_ptr + site, mask=site < B * J, other=0.0).to(ACC)  # [BB, 1]
            k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(ACC) * act  # [BB, MP]
            ku = k[:, None, :, None] * u  # [BB, AP, MP, CP]
            acc1 += ku
            acc2 += ku * u
            accm += k
    if not QUAD:
        span_offs = widen(span, I64) * B * (M * A * C) + poffs
        tl.store(o1_ptr + span_offs, acc1, mask=pmask)
        tl.store(o2_ptr + span_offs, acc2, mask=pmask)
        b2 = (b0 + tl.arange(0, BB))[:, None]
        m2 = tl.arange(0, MP)[None, :]
        moffs = (widen(span, I64) * B + b2) * M + m2  # [BB, MP] into mass[span, B, m]
        tl.store(mass_ptr + moffs, accm, mask=(b2 < B) & (m2 < M))


@triton.jit
def em_backward(
    x_ptr, w_ptr, s_ptr, k_ptr, act_ptr, g1_ptr, g2_ptr, gm_ptr, gk_ptr, gact_ptr, J, B, JN,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr, QUAD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """The coefficients' gradients. Moments: ``(g1, g2, gm) = (gS1, gS2, gmass)``, ``k_ptr``:
    ``r``; ``dr[B, J, m]`` (``gk_ptr``) and ``dact[B, J]`` (``gact_ptr``) stored. Quadratic
    form: ``(g1, g2) = (q, p)`` (unused), ``k_ptr``: ``gQ``; ``dq`` and ``dp``
    ``[span, B, m, a, c]`` (``gk_ptr``, ``gact_ptr``) written once per span."""
    b0 = tl.program_id(0) * BB
    span = tl.program_id(1)
    j_lo = span * JN
    poffs, pmask = parent_tile(b0, B, 0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # the shift
    if QUAD:
        dq = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # dq of the span
        dp = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # dp of the span
    else:
        g1 = tl.load(g1_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # [BB, AP, MP, CP]
        g2 = tl.load(g2_ptr + poffs, mask=pmask, other=0.0).to(ACC)
        b2 = (b0 + tl.arange(0, BB))[:, None]
        m2 = tl.arange(0, MP)[None, :]
        gm = tl.load(gm_ptr + widen(b2, I64) * M + m2, mask=(b2 < B) & (m2 < M), other=0.0)
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_tile(x_ptr, w_ptr, j, b0, B, B, M, A, C, XD, DT, DOT, I64, BB, KP, AP,
                         MP, CP)  # fmt: skip
        u = v - sv  # [BB, AP, MP, CP]
        offs, mask, site = pair_tile(j, b0, B, 0, J, M, I64, BB, MP)  # [BB, MP]
        k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(ACC)  # [BB, MP]: r, or gQ
        if QUAD:
            ku = k[:, None, :, None] * u  # [BB, AP, MP, CP]
            dq += ku
            dp += ku * u
        else:
            g = tl.sum(tl.sum(u * (g1 + g2 * u), axis=3), axis=1) + gm.to(ACC)  # [BB, MP]
            act = tl.load(act_ptr + site, mask=site < B * J, other=0.0).to(ACC)  # [BB, 1]
            tl.store(gk_ptr + offs, g * act, mask=mask)  # dr
            tl.store(gact_ptr + site, tl.sum(g * k, axis=1)[:, None], mask=site < B * J)
    if QUAD:
        span_offs = widen(span, I64) * B * (M * A * C) + poffs
        tl.store(gk_ptr + span_offs, dq, mask=pmask)
        tl.store(gact_ptr + span_offs, dp, mask=pmask)


@triton.jit
def _vote_grad(u, k, g1, g2):
    """``dV = k (g1 + 2 U g2)`` of shifted votes ``u[BB, AP, MB, CP]`` and ``k[BB, MB]``: the
    moments' (``k = r act``, ``g`` their gradients) and the quadratic form's (``k = gQ``,
    ``g = q, p``)."""
    return k[:, None, :, None] * (g1 + 2.0 * u * g2)


@triton.jit
def _block_vote_grad(xt, wt, j, b0, b_end, m0, s_ptr, k_ptr, act_ptr, g1_ptr, g2_ptr, J, B,
                     M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, QUAD: tl.constexpr,
                     ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
                     BB: tl.constexpr, AP: tl.constexpr, MB: tl.constexpr,
                     CP: tl.constexpr):  # fmt: skip
    """``dV`` of child ``j`` at sites ``b0 + [0, BB)`` (below ``b_end``) and parents
    ``m0 + [0, MB)`` as the product's rows ``[R, N]`` in ``DT``: the votes from the pose rows
    ``xt[R, KP]`` and the weights ``wt[KP, N]`` (one ``tl.dot``), shifted, then
    :func:`_vote_grad` (arguments as :func:`em_input_grad`)."""
    v = tl.reshape(tl.dot(xt, wt, input_precision=DOT), (BB, AP, MB, CP))  # the votes
    poffs, pmask = parent_tile(b0, b_end, m0, M, A, C, I64, BB, AP, MB, CP)
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # [BB, AP, MB, CP]
    g1 = tl.load(g1_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    g2 = tl.load(g2_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    offs, mask, site = pair_tile(j, b0, b_end, m0, J, M, I64, BB, MB)  # [BB, MB]
    k = tl.load(k_ptr + offs, mask=mask, other=0.0).to(ACC)  # [BB, MB]
    if not QUAD:
        k = k * tl.load(act_ptr + site, mask=site < B * J, other=0.0).to(ACC)  # r act
    dv = _vote_grad(v - sv, k, g1, g2)  # [BB, AP, MB, CP]
    return to_rows(dv, BB, AP, MB, CP).to(DT)  # [R, N]


@triton.jit
def em_input_grad(
    x_ptr, w_ptr, s_ptr, k_ptr, act_ptr, g1_ptr, g2_ptr, gx_ptr, J, B, JN,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr, QUAD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, MB: tl.constexpr,
    CP: tl.constexpr,
):  # fmt: skip
    """``dX[J, B, a, x] = dV W^T`` of the program's sites and span of children (``k_ptr``:
    ``r``, scaled by ``act``, or ``gQ``; ``g1, g2``: ``gS1, gS2`` or ``q, p``), per child and
    block of ``MB`` parents: the block's votes (one ``tl.dot``), ``dV``, and ``dX += dV W^T``
    (a second), so that the two products' tiles stay small."""
    b0 = tl.program_id(0) * BB
    span = tl.program_id(1)
    j_lo = span * JN
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        xo, xmask = pose_rows(j, b0, B, B, A, XD, I64, BB, KP, AP)  # [R, KP]
        xt = tl.load(x_ptr + xo, mask=xmask, other=0.0).to(DT)  # [R, KP]
        gx = tl.zeros((BB * AP, KP), dtype=ACC)  # [R, KP]
        for m0 in tl.static_range(0, MP, MB):
            wo, wmask = weight_block(j, m0, M, C, XD, I64, KP, MB, CP)
            wt = tl.load(w_ptr + wo, mask=wmask, other=0.0).to(DT)  # [KP, N]
            dvr = _block_vote_grad(xt, wt, j, b0, B, m0, s_ptr, k_ptr, act_ptr, g1_ptr,
                                   g2_ptr, J, B, M, A, C, QUAD, ACC, DT, DOT, I64, BB, AP,
                                   MB, CP)  # fmt: skip
            gx += tl.dot(dvr, tl.trans(wt), input_precision=DOT)  # [R, KP]
        tl.store(gx_ptr + xo, gx, mask=xmask)  # dX[J, B, a, x]


@triton.jit
def em_weight_grad(
    x_ptr, w_ptr, s_ptr, k_ptr, act_ptr, g1_ptr, g2_ptr, gw_ptr, J, B, BN,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr, QUAD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MB: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``dW[span, j, x, m, c] = sum_{b in span} X^T dV`` of one child ``j`` and parents
    ``m0 + [0, MB)`` over its span of ``BN`` sites (arguments as :func:`em_input_grad`)."""
    j = tl.program_id(0)
    span = tl.program_id(1)
    m0 = tl.program_id(2) * MB
    b_lo = span * BN
    b_hi = tl.minimum(b_lo + BN, B)
    wo, wmask = weight_block(j, m0, M, C, XD, I64, KP, MB, CP)  # [KP, N]
    wt = tl.load(w_ptr + wo, mask=wmask, other=0.0).to(DT)  # the parents' weights [KP, N]
    gw = tl.zeros((KP, MB * CP), dtype=ACC)  # dW of the span, [x, (m, c)]
    for b0 in range(b_lo, b_hi, BB):
        xo, xmask = pose_rows(j, b0, b_hi, B, A, XD, I64, BB, KP, AP)  # [R, KP]
        xt = tl.load(x_ptr + xo, mask=xmask, other=0.0).to(DT)  # [R, KP]
        dvr = _block_vote_grad(xt, wt, j, b0, b_hi, m0, s_ptr, k_ptr, act_ptr, g1_ptr, g2_ptr,
                               J, B, M, A, C, QUAD, ACC, DT, DOT, I64, BB, AP, MB, CP)  # fmt: skip
        gw += tl.dot(tl.trans(xt), dvr, input_precision=DOT)  # [KP, N]
    # dW[span, J, x, m, c]: the weights' own offsets, one span further per span
    tl.store(gw_ptr + widen(span, I64) * J * (XD * M * C) + wo, gw, mask=wmask)
