"""Triton kernels of the routed and the weighted pass: the votes built on chip as matrix
products (tiles.py) and never stored, every sum kept in registers and written once.

Letters and layouts as in capsctl/layers/passes/routed.py and tiles.py. Four kernels, none
with an atomic:

- :func:`pass_forward` (grid: site blocks x parent blocks, child spans). A program owns ``BB``
  parent sites and ``MP`` parents (all of them, unless one child's weights for all of them
  outgrow a program: plan.py) and loops over its span of ``JN`` children; per child it builds
  the votes ``V[BB, a, m, c]`` (one ``tl.dot``), then routed (``ROUTED``):
  ``A = scale * sum_{a,c} V P``, ``R = softmax_m(A)`` (stored); weighted: ``R`` read, or made
  from the rows ``[J, B, m]`` of the agreement or of ``R`` and ``dR`` (below).
  ``S += R V`` stays in registers; the program writes its span's sum once, to
  ``S[span, B, m, a, c]`` (the launcher adds the spans).
- :func:`pass_backward` (same grid), from ``G = d loss / d S``: the votes again,
  ``dR = sum_{a,c} V G``; routed: ``dA = R (dR - sum_m R dR)`` (stored for the gradients of
  the inputs and the weights, ``NEED_A``), ``dP += scale sum_j dA V`` (registers, written once
  per span); weighted: ``dR`` stored.
- :func:`pass_input_grad` (grid: site blocks x child spans): ``dV = R G + dA (scale P)``
  (weighted ``R G``) needs no votes once ``dA`` is known, so per child ``dX = dV W^T`` is one
  ``tl.dot`` per block of ``MB`` parents, stored (a site and a child belong to one program).
- :func:`pass_weight_grad` (grid: children x site spans x parent blocks): ``dV`` needs no
  votes once ``dA`` is known, ``dV = R G + dA (scale P)`` (weighted ``R G``), so a program
  owns one child and ``MB`` of its parents and loops over its span of sites in blocks of
  ``BB``, summing ``dW += X^T dV`` (one ``tl.dot`` per block) in registers; it writes its
  span's ``dW[span, J, x, m, c]`` once (the launcher adds the spans).

The routed forward and backward need every parent of a child in one program (the softmax over
``m``). Where a block holds fewer, ops.py composes the routed pass of two launches each way,
both on blocks of parents: forward, the agreement ``A[J, B, m]`` (weighted
:func:`pass_backward` with ``G = P``, times ``scale``), then :func:`pass_forward` with
``COEF = 1``: each program reads its children's rows of ``A``, takes ``R = softmax_m(A)`` of
its block (stored) and sums ``S``; backward, ``dR`` (weighted :func:`pass_backward`), then
:func:`pass_forward` with ``COEF = 2``: ``dA = R (dR - sum_m R dR)`` of its block (stored)
and ``dP = scale sum_j dA V``. The votes are built twice each way, no ``[J, B, m]`` operator
runs between the launches.

Masks cut the padded dimensions (tiles.py) and the sites past a program's span.
"""

from __future__ import annotations

import triton
import triton.language as tl

from capsctl.layers.backend.triton.tiles import (
    block_origin,
    coef_tile,
    parent_tile,
    pose_rows,
    softmax_rows,
    to_rows,
    vote_block,
    widen,
)

__all__ = ["pass_backward", "pass_forward", "pass_input_grad", "pass_weight_grad"]


@triton.jit
def _coefficients(r_ptr, p_ptr, q_ptr, j, b0, B, m0, M: tl.constexpr, COEF: tl.constexpr,
                 ACC: tl.constexpr, I64: tl.constexpr, BB: tl.constexpr, MP: tl.constexpr,
                 MF: tl.constexpr):  # fmt: skip
    """Child ``j``'s coefficients ``[BB, MP]`` for the weighted sum of the program's block
    (sites ``b0``, parents ``m0``), from rows ``[J, B, m]`` over all ``MF`` (padded) parents:
    ``COEF`` 0: ``R`` read from ``r_ptr``; 1: ``R = softmax_m(A)`` of the agreement ``A`` in
    ``r_ptr``, stored to ``q_ptr``; 2: ``dA = R (dR - sum_m R dR)`` of ``R`` in ``r_ptr`` and
    ``dR`` in ``p_ptr``, stored to ``q_ptr``. A program reads its whole row for the sums over
    ``m`` and writes only its block."""
    roffs, rmask, _ = coef_tile(j, b0, B, m0, B, M, I64, BB, MP)  # [BB, MP]
    r = tl.load(r_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BB, MP]
    if COEF != 0:
        foffs, fmask, f2 = coef_tile(j, b0, B, 0, B, M, I64, BB, MF)  # [BB, MF]: the rows
        row = tl.load(r_ptr + foffs, mask=fmask, other=0.0).to(ACC)  # [BB, MF]
        if COEF == 1:
            row = tl.where(f2 < M, row, float("-inf"))
            top = tl.max(row, axis=1)  # [BB]
            den = tl.sum(tl.exp(row - top[:, None]), axis=1)  # [BB]
            r = tl.exp(r - top[:, None]) / den[:, None]  # [BB, MP]
        else:
            drow = tl.load(p_ptr + foffs, mask=fmask, other=0.0).to(ACC)  # [BB, MF]
            t = tl.sum(row * drow, axis=1)  # [BB]: sum_m R dR
            dr = tl.load(p_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BB, MP]
            r = r * (dr - t[:, None])  # [BB, MP]
        tl.store(q_ptr + roffs, r, mask=rmask)
    return r


@triton.jit
def pass_forward(
    x_ptr, w_ptr, p_ptr, r_ptr, q_ptr, s_ptr, J, B, JN, scale,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ROUTED: tl.constexpr, COEF: tl.constexpr, ACC: tl.constexpr, DT: tl.constexpr,
    DOT: tl.constexpr, I64: tl.constexpr, BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr,
    MP: tl.constexpr, MF: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``S[span, B, m, a, c] = sum_{j in span} R V`` of the program's sites and block of ``MP``
    parents; ``ROUTED`` (one block holds every parent): ``R`` from the agreement with ``P``
    (written to ``r_ptr``), else the coefficients of :func:`_coefficients` (``COEF``; 2: the sum
    times ``scale``, ``dP``)."""
    b0, m0 = block_origin(M, BB, MP)
    span = tl.program_id(1)
    j_lo = span * JN
    poffs, pmask = parent_tile(b0, B, m0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    if ROUTED:
        pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC) * scale  # scale P
    acc = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # S of the span
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_block(x_ptr, w_ptr, j, b0, B, B, m0, M, A, C, XD, DT, DOT, I64, BB, KP,
                          AP, MP, CP)  # fmt: skip
        if ROUTED:
            roffs, rmask, m2 = coef_tile(j, b0, B, m0, B, M, I64, BB, MP)  # [BB, MP]
            logit = tl.sum(tl.sum(v * pv, axis=3), axis=1)  # [BB, MP]
            r = softmax_rows(logit, m2, M)  # [BB, MP]
            tl.store(r_ptr + roffs, r, mask=rmask)
        else:
            r = _coefficients(r_ptr, p_ptr, q_ptr, j, b0, B, m0, M, COEF, ACC, I64, BB, MP, MF)
        acc += r[:, None, :, None] * v  # [BB, AP, MP, CP]
    if COEF == 2:
        acc = acc * scale
    s_offs = widen(span, I64) * B * (M * A * C) + poffs
    tl.store(s_ptr + s_offs, acc, mask=pmask)


@triton.jit
def pass_backward(
    x_ptr, w_ptr, r_ptr, g_ptr, gp_ptr, da_ptr, J, B, JN, scale,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ROUTED: tl.constexpr, NEED_P: tl.constexpr, NEED_A: tl.constexpr,
    ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr,
    I64: tl.constexpr, BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr,
    MP: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """From ``G[B, m, a, c]`` (``g_ptr``), of the program's sites and block of ``MP`` parents:
    routed (one block holds every parent): ``dP[span, B, m, a, c]`` written once per span
    (``NEED_P``) and ``dA[J, B, m]`` stored (``NEED_A``); weighted: ``scale dR[J, B, m]``
    stored (``NEED_P``, in ``gp_ptr``; with ``G = P``, the agreement)."""
    b0, m0 = block_origin(M, BB, MP)
    span = tl.program_id(1)
    j_lo = span * JN
    poffs, pmask = parent_tile(b0, B, m0, M, A, C, I64, BB, AP, MP, CP)  # [BB, AP, MP, CP]
    gv = tl.load(g_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # [BB, AP, MP, CP]
    gp = tl.zeros((BB, AP, MP, CP), dtype=ACC)  # dP of the span (routed), before the scale
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        v, _ = vote_block(x_ptr, w_ptr, j, b0, B, B, m0, M, A, C, XD, DT, DOT, I64, BB, KP,
                          AP, MP, CP)  # fmt: skip
        roffs, rmask, _ = coef_tile(j, b0, B, m0, B, M, I64, BB, MP)  # [BB, MP]
        dr = tl.sum(tl.sum(v * gv, axis=3), axis=1)  # [BB, MP]
        if ROUTED:
            r = tl.load(r_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BB, MP]
            da = r * (dr - tl.sum(r * dr, axis=1)[:, None])  # [BB, MP], before the scale
            if NEED_P:
                gp += da[:, None, :, None] * v  # [BB, AP, MP, CP]
            if NEED_A:
                tl.store(da_ptr + roffs, da, mask=rmask)  # dA[J, B, m]
        elif NEED_P:
            tl.store(gp_ptr + roffs, dr * scale, mask=rmask)  # dR[J, B, m]
    if ROUTED and NEED_P:
        gp_offs = widen(span, I64) * B * (M * A * C) + poffs
        tl.store(gp_ptr + gp_offs, gp * scale, mask=pmask)


@triton.jit
def pass_weight_grad(
    x_ptr, p_ptr, r_ptr, da_ptr, g_ptr, gw_ptr, J, B, BN, scale,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ROUTED: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr, MB: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``dW[span, j, x, m, c] = sum_{b in span} X^T dV`` of one child ``j`` and parents
    ``m0 + [0, MB)`` over its span of ``BN`` sites, ``dV = R G + dA (scale P)`` (routed; ``dA``
    from :func:`pass_backward`) or ``R G`` (weighted)."""
    j = tl.program_id(0)
    span = tl.program_id(1)
    m0 = tl.program_id(2) * MB
    b_lo = span * BN
    b_hi = tl.minimum(b_lo + BN, B)
    gw = tl.zeros((KP, MB * CP), dtype=ACC)  # dW of the span, [x, (m, c)]
    for b0 in range(b_lo, b_hi, BB):
        xo, xmask = pose_rows(j, b0, b_hi, B, A, XD, I64, BB, KP, AP)  # [R, KP]
        xt = tl.load(x_ptr + xo, mask=xmask, other=0.0).to(ACC)  # [R, KP]
        poffs, pmask = parent_tile(b0, b_hi, m0, M, A, C, I64, BB, AP, MB, CP)
        gv = tl.load(g_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # [BB, AP, MB, CP]
        roffs, rmask, _ = coef_tile(j, b0, b_hi, m0, B, M, I64, BB, MB)  # [BB, MB]
        r = tl.load(r_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BB, MB]
        dv = r[:, None, :, None] * gv  # [BB, AP, MB, CP]
        if ROUTED:
            pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC) * scale
            da = tl.load(da_ptr + roffs, mask=rmask, other=0.0)  # [BB, MB]
            dv += da[:, None, :, None] * pv  # [BB, AP, MB, CP]
        gw += tl.dot(tl.trans(xt), to_rows(dv, BB, AP, MB, CP), input_precision=DOT)  # [KP, N]
    kk = tl.arange(0, KP)[:, None]
    nn = tl.arange(0, MB * CP)[None, :]
    mm = m0 + nn // CP
    cc = nn % CP
    offs = ((widen(span, I64) * J + j) * XD + kk) * (M * C) + mm * C + cc  # [KP, N]
    tl.store(gw_ptr + offs, gw, mask=(kk < XD) & (mm < M) & (cc < C))


@triton.jit
def pass_input_grad(
    w_ptr, p_ptr, r_ptr, da_ptr, g_ptr, gx_ptr, J, B, JN, scale,
    M: tl.constexpr, A: tl.constexpr, C: tl.constexpr, XD: tl.constexpr,
    ROUTED: tl.constexpr, ACC: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr,
    I64: tl.constexpr, BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr,
    MP: tl.constexpr, MB: tl.constexpr, CP: tl.constexpr,
):  # fmt: skip
    """``dX[J, B, a, x] = dV W^T`` of the program's sites and span of children, with
    ``dV = R G + dA (scale P)`` (routed; ``dA`` from :func:`pass_backward`) or ``R G``
    (weighted). No votes are needed: per child and block of ``MB`` parents, one load of the
    coefficients and the weights and one ``tl.dot`` (in ``DT``, float32 sums) over the block's
    pose columns ``(m, c)``, so that the weights' tile stays small for wide poses."""
    b0 = tl.program_id(0) * BB
    span = tl.program_id(1)
    j_lo = span * JN
    nn = tl.arange(0, MB * CP)
    kk = tl.arange(0, KP)
    for j in range(j_lo, tl.minimum(j_lo + JN, J)):
        gx = tl.zeros((BB * AP, KP), dtype=ACC)  # [R, KP]
        for m0 in range(0, MP, MB):  # a loop, not unrolled (unrolled: 188 registers at 100 parents)
            poffs, pmask = parent_tile(b0, B, m0, M, A, C, I64, BB, AP, MB, CP)
            gv = tl.load(g_ptr + poffs, mask=pmask, other=0.0).to(ACC)  # [BB, AP, MB, CP]
            roffs, rmask, _ = coef_tile(j, b0, B, m0, B, M, I64, BB, MB)  # [BB, MB]
            r = tl.load(r_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BB, MB]
            dv = r[:, None, :, None] * gv  # [BB, AP, MB, CP]
            if ROUTED:
                pv = tl.load(p_ptr + poffs, mask=pmask, other=0.0).to(ACC) * scale
                da = tl.load(da_ptr + roffs, mask=rmask, other=0.0).to(ACC)  # [BB, MB]
                dv += da[:, None, :, None] * pv  # [BB, AP, MB, CP]
            mm = m0 + nn // CP  # [N]: the column's parent
            cc = nn % CP  # [N]: the column's pose column
            wo = (widen(j, I64) * XD + kk[None, :]) * (M * C) + (mm * C + cc)[:, None]
            wmask = ((mm < M) & (cc < C))[:, None] & (kk < XD)[None, :]
            wtt = tl.load(w_ptr + wo, mask=wmask, other=0.0).to(DT)  # W^T [N, KP]
            dvr = to_rows(dv, BB, AP, MB, CP).to(DT)  # [R, N]
            gx += tl.dot(dvr, wtt, input_precision=DOT)  # [R, KP]
        xo, xmask = pose_rows(j, b0, B, B, A, XD, I64, BB, KP, AP)  # [R, KP]
        tl.store(gx_ptr + xo, gx, mask=xmask)  # dX[J, B, a, x]
