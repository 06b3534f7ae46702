"""Triton kernels of EM routing's E-step fused into the next M-step's moments, so that the
assignments ``R[B, J, m]`` are never stored (capsctl/layers/backend/triton/estep_moments_ops.py).

Layouts and tiling of em.py (``x[J, B, a, x]``, ``w[J, x, m, c]``, parent-sized
``[B, m, a, c]`` and ``[B, m]``, child-sized ``[B, J]``); a program owns ``BB`` parent sites and
loops over its span of ``JN`` children; each child's votes at the block are one ``tl.dot``,
shifted ``U = V - s`` on chip. The E-step's operands come from the last M-step: ``q, p[B, m,
a, c]`` and ``c[B, m]``, so that ``z = c - Q / 2`` with ``Q = sum_{a,c} (q U + p U^2)`` is
``log a_j + log p_ij`` (Hinton, Sabour, Frosst, ICLR 2018), and ``R = exp(z - lse)``, where
``lse[B, J]`` is the log of the sum of ``exp(z)`` over every parent the child votes for.

- :func:`em_estep_stats`: ``zmax = max_m z`` and ``esum = sum_m exp(z - zmax)`` per entry
  ``[B, J]``; combined over the windows a child falls in by the launcher (``lse``).
- :func:`em_estep_moments`: with ``k = R act``, ``S1 = sum_j k U``, ``S2 = sum_j k U^2`` and
  ``mass = sum_j k`` (em.py's moments, ``R`` built on chip), per span.
- :func:`em_estep_rowdot`, the backward's first pass, from ``gS1, gS2, gmass``:
  ``g = sum_{a,c} (gS1 U + gS2 U^2) + gmass``, ``dact = sum_m g R`` and
  ``T = sum_m R g act`` per entry ``[B, J]``; the launcher sums ``T`` over the child's windows
  (``Tc``), the softmax's backward: ``dz = R (g act - Tc)``.
- :func:`em_estep_parent_grad`: ``dc = sum_j dz``, ``dq = sum_j dQ U``, ``dp = sum_j dQ U^2``
  with ``dQ = -dz / 2``, per span.
- :func:`em_estep_input_grad` and :func:`em_estep_weight_grad`: ``dV = k (gS1 + 2 U gS2) +
  dQ (q + 2 U p)`` per child and block of ``MB`` parents (its votes and everything above
  recomputed), ``dX += dV W^T`` and ``dW += X^T dV``, as em.py's.

No atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from capsctl.layers.backend.triton.em import pair_tile
from capsctl.layers.backend.triton.tiles import (
    block_origin,
    parent_tile,
    pose_rows,
    to_rows,
    vote_block,
    vote_tile,
    weight_block,
    widen,
)

__all__ = [
    "em_estep_input_grad",
    "em_estep_moments",
    "em_estep_parent_grad",
    "em_estep_rowdot",
    "em_estep_stats",
    "em_estep_weight_grad",
]


@triton.jit
def _row_tile(b0, b_end, m0, M: tl.constexpr, I64: tl.constexpr, BB: tl.constexpr,
              MB: tl.constexpr):  # fmt: skip
    """Offsets ``[BB, MB]`` into a parent-sized ``T[B, m]`` at sites ``b0 + [0, BB)`` and
    parents ``m0 + [0, MB)``, their mask (sites below ``b_end``) and the parents ``m2[1, MB]``."""
    b2 = (b0 + tl.arange(0, BB))[:, None]
    m2 = (m0 + tl.arange(0, MB))[None, :]
    return widen(b2, I64) * M + m2, (b2 < b_end) & (m2 < M), m2


@triton.jit
def _assignments(u, qv, pv, cv, lse, m2, M: tl.constexpr):
    """``R = exp(c - Q / 2 - lse)`` of shifted votes ``u[BB, AP, MB, CP]`` (``Q = sum_{a,c}
    (q U + p U^2)``), ``cv[BB, MB]``, ``lse[BB, 1]``; 0 for padded parents -> ``[BB, MB]``."""
    quad = tl.sum(tl.sum(u * (qv + pv * u), axis=3), axis=1)  # [BB, MB]
    return tl.where(m2 < M, tl.exp(cv - 0.5 * quad - lse), 0.0)


@triton.jit
def _moment_grad(u, g1, g2, gm):
    """``g = sum_{a,c} (gS1 U + gS2 U^2) + gmass`` -> ``[BB, MB]``."""
    return tl.sum(tl.sum(u * (g1 + g2 * u), axis=3), axis=1) + gm


@triton.jit
def em_estep_stats(
    x_ptr, w_ptr, s_ptr, q_ptr, p_ptr, c_ptr, zmax_ptr, esum_ptr, J, B, JN,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr, ACC: tl.constexpr,
    DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr, BB: tl.constexpr,
    KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``zmax[B, J] = max_m z`` and ``esum[B, J] = sum_m exp(z - zmax)``."""
    b0 = tl.program_id(0) * BB
    j_lo = tl.program_id(1) * JN
    poffs, pmask = parent_tile(b0, B, 0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    qv = tl.load(q_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    coffs, cmask, m2 = _row_tile(b0, B, 0, M, I64, BB, MP)  # [BB, MP]
    cv = tl.load(c_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_tile(x_ptr, w_ptr, j, b0, B, B, M, A, C, XD, DT, DOT, I64, BB, KP, AP,
                         MP, CP)  # fmt: skip
        u = v - sv  # [BB, AP, MP, CP]
        quad = tl.sum(tl.sum(u * (qv + pv * u), axis=3), axis=1)  # [BB, MP]
        z = tl.where(m2 < M, cv - 0.5 * quad, float("-inf"))  # [BB, MP]
        top = tl.max(z, axis=1)  # [BB]
        esum = tl.sum(tl.exp(z - top[:, None]), axis=1)  # [BB]
        _, _, site = pair_tile(j, b0, B, 0, J, M, I64, BB, MP)  # [BB, 1]
        tl.store(zmax_ptr + site, top[:, None], mask=site < B * J)
        tl.store(esum_ptr + site, esum[:, None], mask=site < B * J)


@triton.jit
def em_estep_moments(
    x_ptr, w_ptr, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr, act_ptr, o1_ptr, o2_ptr, mass_ptr, J,
    B, JN, M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``o1, o2[span, B, m, a, c] = sum_{j in span} k U, k U^2`` and ``mass[span, B, m] =
    sum k`` with ``k = R act``, ``R`` from the E-step's operands and ``lse``."""
    b0, m0 = block_origin(M, BB, MP)
    span = tl.program_id(1)
    j_lo = span * JN
    poffs, pmask = parent_tile(b0, B, m0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    qv = tl.load(q_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    coffs, cmask, m2 = _row_tile(b0, B, m0, M, I64, BB, MP)  # [BB, MP]
    cv = tl.load(c_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    acc1 = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # S1 of the span
    acc2 = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # S2 of the span
    accm = tl.zeros((BB, MP), dtype=ACC)  # mass of the span
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_block(x_ptr, w_ptr, j, b0, B, B, m0, M, A, C, XD, DT, DOT, I64, BB, KP,
                          AP, MP, CP)  # fmt: skip
        u = v - sv  # [BB, AP, MP, CP]
        _, _, site = pair_tile(j, b0, B, 0, J, M, I64, BB, MP)  # [BB, 1]
        smask = site < B * J
        lse = tl.load(lse_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
        act = tl.load(act_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
        k = _assignments(u, qv, pv, cv, lse, m2, M) * act  # [BB, MP]
        ku = k[:, None, :, None] * u  # [BB, AP, MP, CP]
        acc1 += ku
        acc2 += ku * u
        accm += k
    span_offs = widen(span, I64) * B * (M * A * C) + poffs
    tl.store(o1_ptr + span_offs, acc1, mask=pmask)
    tl.store(o2_ptr + span_offs, acc2, mask=pmask)
    tl.store(mass_ptr + widen(span, I64) * B * M + coffs, accm, mask=cmask)


@triton.jit
def em_estep_rowdot(
    x_ptr, w_ptr, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr, act_ptr, g1_ptr, g2_ptr, gm_ptr, t_ptr,
    gact_ptr, J, B, JN, M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``T[blocks, B, J] = sum_m R g act`` and ``dact[blocks, B, J] = sum_m g R`` over each
    block of ``MP`` parents (the launcher adds the blocks) from ``gS1, gS2`` (``g1_ptr``,
    ``g2_ptr``, ``[B, m, a, c]``) and ``gmass[B, m]``."""
    b0, m0 = block_origin(M, BB, MP)
    j_lo = tl.program_id(1) * JN
    poffs, pmask = parent_tile(b0, B, m0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    qv = tl.load(q_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    g1 = tl.load(g1_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    g2 = tl.load(g2_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    coffs, cmask, m2 = _row_tile(b0, B, m0, M, I64, BB, MP)  # [BB, MP]
    cv = tl.load(c_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    gm = tl.load(gm_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_block(x_ptr, w_ptr, j, b0, B, B, m0, M, A, C, XD, DT, DOT, I64, BB, KP,
                          AP, MP, CP)  # fmt: skip
        u = v - sv  # [BB, AP, MP, CP]
        _, _, site = pair_tile(j, b0, B, 0, J, M, I64, BB, MP)  # [BB, 1]
        smask = site < B * J
        lse = tl.load(lse_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
        act = tl.load(act_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
        r = _assignments(u, qv, pv, cv, lse, m2, M)  # [BB, MP]
        gr = _moment_grad(u, g1, g2, gm) * r  # [BB, MP]
        part = site + (m0 // MP) * (B * J)  # [BB, 1]: this block of parents' partial sums
        tl.store(t_ptr + part, tl.sum(gr * act, axis=1)[:, None], mask=smask)
        tl.store(gact_ptr + part, tl.sum(gr, axis=1)[:, None], mask=smask)


@triton.jit
def em_estep_parent_grad(
    x_ptr, w_ptr, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr, act_ptr, g1_ptr, g2_ptr, gm_ptr, tc_ptr,
    dq_ptr, dp_ptr, dc_ptr, J, B, JN, M: tl.constexpr, A: tl.constexpr, C: tl.constexpr,
    XD: tl.constexpr, ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr,
    I64: tl.constexpr, BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr,
    CP: tl.constexpr,
):  # fmt: skip
    """``dq, dp[span, B, m, a, c] = sum_{j in span} dQ U, dQ U^2`` and ``dc[span, B, m] =
    sum dz``, with ``dz = R (g act - Tc)`` (``Tc[B, J]``: ``T`` summed over the child's
    windows) and ``dQ = -dz / 2``."""
    b0, m0 = block_origin(M, BB, MP)
    span = tl.program_id(1)
    j_lo = span * JN
    poffs, pmask = parent_tile(b0, B, m0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    qv = tl.load(q_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    g1 = tl.load(g1_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    g2 = tl.load(g2_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    coffs, cmask, m2 = _row_tile(b0, B, m0, M, I64, BB, MP)  # [BB, MP]
    cv = tl.load(c_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    gm = tl.load(gm_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    dq = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # dq of the span
    dp = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # dp of the span
    dc = tl.zeros((BB, MP), dtype=ACC)  # dc of the span
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_block(x_ptr, w_ptr, j, b0, B, B, m0, M, A, C, XD, DT, DOT, I64, BB, KP,
                          AP, MP, CP)  # fmt: skip
        u = v - sv  # [BB, AP, MP, CP]
        _, _, site = pair_tile(j, b0, B, 0, J, M, I64, BB, MP)  # [BB, 1]
        smask = site < B * J
        lse = tl.load(lse_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
        act = tl.load(act_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
        tc = tl.load(tc_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
        r = _assignments(u, qv, pv, cv, lse, m2, M)  # [BB, MP]
        dz = r * (_moment_grad(u, g1, g2, gm) * act - tc)  # [BB, MP]
        dc += dz
        du = (-0.5 * dz)[:, None, :, None] * u  # [BB, AP, MP, CP]
        dq += du
        dp += du * u
    span_offs = widen(span, I64) * B * (M * A * C) + poffs
    tl.store(dq_ptr + span_offs, dq, mask=pmask)
    tl.store(dp_ptr + span_offs, dp, mask=pmask)
    tl.store(dc_ptr + widen(span, I64) * B * M + coffs, dc, mask=cmask)


@triton.jit
def _block_vote_grad(xt, wt, j, b0, b_end, m0, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr, act_ptr,
                     g1_ptr, g2_ptr, gm_ptr, tc_ptr, J, B, M: tl.constexpr, A: tl.constexpr,
                     C: tl.constexpr, ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr,
                     I64: tl.constexpr, BB: tl.constexpr, AP: tl.constexpr, MB: tl.constexpr,
                     CP: tl.constexpr):  # fmt: skip
    """``dV = k (gS1 + 2 U gS2) + dQ (q + 2 U p)`` of child ``j`` at sites ``b0 + [0, BB)``
    (below ``b_end``) and parents ``m0 + [0, MB)``, as the product's rows ``[R, N]`` in
    ``DT``: the votes from ``xt[R, KP]`` and ``wt[KP, N]`` (one ``tl.dot``), then ``R``,
    ``g``, ``k = R act`` and ``dQ = -R (g act - Tc) / 2`` of the block."""
    v = tl.reshape(tl.dot(xt, wt, input_precision=DOT), (BB, AP, MB, CP))  # the votes
    poffs, pmask = parent_tile(b0, b_end, m0, M, A, C, I64, BB, AP, MB, CP)
    sv = tl.load(s_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # [BB, AP, MB, CP]
    qv = tl.load(q_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    g1 = tl.load(g1_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    g2 = tl.load(g2_ptr + poffs, mask=pmask, other=0.0).to(ACC)
    coffs, cmask, m2 = _row_tile(b0, b_end, m0, M, I64, BB, MB)  # [BB, MB]
    cv = tl.load(c_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    gm = tl.load(gm_ptr + coffs, mask=cmask, other=0.0).to(ACC)
    _, _, site = pair_tile(j, b0, b_end, m0, J, M, I64, BB, MB)  # [BB, 1]
    smask = site < B * J
    lse = tl.load(lse_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
    act = tl.load(act_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
    tc = tl.load(tc_ptr + site, mask=smask, other=0.0).to(ACC)  # [BB, 1]
    u = v - sv  # [BB, AP, MB, CP]
    r = _assignments(u, qv, pv, cv, lse, m2, M)  # [BB, MB]
    k = r * act  # [BB, MB]
    dquad = -0.5 * r * (_moment_grad(u, g1, g2, gm) * act - tc)  # [BB, MB]
    dv = k[:, None, :, None] * (g1 + 2.0 * u * g2) + dquad[:, None, :, None] * (qv + 2.0 * u * pv)
    return to_rows(dv, BB, AP, MB, CP).to(DT)  # [R, N]


@triton.jit
def em_estep_input_grad(
    x_ptr, w_ptr, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr, act_ptr, g1_ptr, g2_ptr, gm_ptr, tc_ptr,
    gx_ptr, J, B, JN, M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, MB: tl.constexpr,
    CP: tl.constexpr,
):  # fmt: skip
    """``dX[J, B, a, x] = dV W^T`` of the program's sites and span of children, per child and
    block of ``MB`` parents (:func:`_block_vote_grad`, then a second ``tl.dot``)."""
    b0 = tl.program_id(0) * BB
    j_lo = tl.program_id(1) * JN
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        xo, xmask = pose_rows(j, b0, B, B, A, XD, I64, BB, KP, AP)  # [R, KP]
        xt = tl.load(x_ptr + xo, mask=xmask, other=0.0).to(DT)  # [R, KP]
        gx = tl.zeros((BB * AP, KP), dtype=ACC)  # [R, KP]
        # a loop, not unrolled: unrolled, each block's five parent-sized tiles were loaded
        # ahead and held (183 registers a thread on sm_90a, against 168 allowed)
        for m0 in range(0, MP, MB):
            wo, wmask = weight_block(j, m0, M, C, XD, I64, KP, MB, CP)
            wt = tl.load(w_ptr + wo, mask=wmask, other=0.0).to(DT)  # [KP, N]
            dvr = _block_vote_grad(xt, wt, j, b0, B, m0, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr,
                                   act_ptr, g1_ptr, g2_ptr, gm_ptr, tc_ptr, J, B, M, A, C, ACC,
                                   DT, DOT, I64, BB, AP, MB, CP)  # fmt: skip
            gx += tl.dot(dvr, tl.trans(wt), input_precision=DOT)  # [R, KP]
        tl.store(gx_ptr + xo, gx, mask=xmask)  # dX[J, B, a, x]


@triton.jit
def em_estep_weight_grad(
    x_ptr, w_ptr, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr, act_ptr, g1_ptr, g2_ptr, gm_ptr, tc_ptr,
    gw_ptr, J, B, BN, M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MB: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``dW[span, j, x, m, c] = sum_{b in span} X^T dV`` of one child ``j`` and parents
    ``m0 + [0, MB)`` over its span of ``BN`` sites."""
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
        dvr = _block_vote_grad(xt, wt, j, b0, b_hi, m0, s_ptr, q_ptr, p_ptr, c_ptr, lse_ptr,
                               act_ptr, g1_ptr, g2_ptr, gm_ptr, tc_ptr, J, B, M, A, C, ACC, DT,
                               DOT, I64, BB, AP, MB, CP)  # fmt: skip
        gw += tl.dot(tl.trans(xt), dvr, input_precision=DOT)  # [KP, N]
    # dW[span, J, x, m, c]: the weights' own offsets, one span further per span
    tl.store(gw_ptr + widen(span, I64) * J * (XD * M * C) + wo, gw, mask=wmask)
