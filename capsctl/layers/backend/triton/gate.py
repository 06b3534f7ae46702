"""Triton kernels of self-routing's gate (Hahn, Pyeon, Kim, NeurIPS 2019): each child's
coefficients from its own pose, and their gradients, in one kernel each.

Letters and layouts as in capsctl/layers/passes/gated.py: child poses flattened to
``x[J, B, D]`` (``D = a*x``), routing weights ``wr[J, D, m]``, biases ``br[J, m]``, child
activations ``act[B, J]``, coefficient-sized tensors ``[J, B, m]``; all contiguous.

- :func:`gate_forward` (grid: site blocks x children). A program owns ``BB`` sites of one
  child ``j``: the logits ``L = X W^route + b^route`` (one ``tl.dot``, ``[BB, DP] @ [DP, MP]``),
  ``c = softmax_m(L)`` and the mass ``c a``, both stored. The logits are never stored.
- :func:`gate_backward` (same grid), from ``G = d loss / d mass``: ``d act = sum_m G c``
  (``NEED_A``), ``dL = c (G a - sum_m c G a)`` (stored where ``NEED_L``: the routing weights'
  gradient is a product over the sites, ``X^T dL``, left to a batched matrix product) and
  ``dX = dL W^route^T`` (one ``tl.dot``, ``NEED_X``).

Each entry is written by one program: no atomics. Every dimension is padded to a power of two
of at least 16 (``DP``, ``MP``, ``BB``: a ``tl.dot``'s smallest tile); padded entries load as
zero and the padded parents are left out of the softmax. ``ACC``, ``DOT`` and ``I64`` as in
tiles.py (float32 sums, float64 for float64 inputs; int64 offsets only past ``2**31``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from capsctl.layers.backend.triton.tiles import softmax_rows, widen

__all__ = ["gate_backward", "gate_forward"]


@triton.jit
def _site_tiles(j, b0, B, J, M: tl.constexpr, D: tl.constexpr, I64: tl.constexpr,
                BB: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr):  # fmt: skip
    """Child ``j`` at sites ``b0 + [0, BB)``: offsets and masks of its pose rows ``[BB, DP]``
    in ``x[J, B, D]``, of its coefficients ``[BB, MP]`` in ``[J, B, m]``, of its activations
    ``[BB]`` in ``act[B, J]``, and the parent index ``m2[1, MP]``."""
    bb = b0 + tl.arange(0, BB)  # [BB]
    b2 = bb[:, None]
    d2 = tl.arange(0, DP)[None, :]
    m2 = tl.arange(0, MP)[None, :]
    row = widen(j, I64) * B + b2  # [BB, 1]: the (child, site) row
    x_offs = row * D + d2  # [BB, DP]
    c_offs = row * M + m2  # [BB, MP]
    a_offs = widen(bb, I64) * J + j  # [BB]
    return x_offs, (b2 < B) & (d2 < D), c_offs, (b2 < B) & (m2 < M), a_offs, bb < B, m2


@triton.jit
def _route_weights(wr_ptr, j, M: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr,
                   I64: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr):  # fmt: skip
    """Child ``j``'s routing weights ``W^route[DP, MP]`` (padded entries 0)."""
    d2 = tl.arange(0, DP)[:, None]
    m2 = tl.arange(0, MP)[None, :]
    offs = (widen(j, I64) * D + d2) * M + m2  # [DP, MP]
    return tl.load(wr_ptr + offs, mask=(d2 < D) & (m2 < M), other=0.0).to(ACC)


@triton.jit
def gate_forward(
    x_ptr, wr_ptr, br_ptr, act_ptr, coef_ptr, mass_ptr, J, B,
    M: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
    I64: tl.constexpr, BB: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr,
):  # fmt: skip
    """``c = softmax_m(X W^route + b^route)`` and ``c a`` of child ``program_id(1)`` at the
    program's sites, stored to ``coef_ptr`` and ``mass_ptr``."""
    b0 = tl.program_id(0) * BB
    j = tl.program_id(1)
    x_offs, x_mask, c_offs, c_mask, a_offs, a_mask, m2 = _site_tiles(
        j, b0, B, J, M, D, I64, BB, DP, MP
    )
    xt = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0).to(ACC)  # [BB, DP]
    wt = _route_weights(wr_ptr, j, M, D, ACC, I64, DP, MP)  # [DP, MP]
    bias = tl.load(br_ptr + widen(j, I64) * M + m2, mask=m2 < M, other=0.0).to(ACC)  # [1, MP]
    logit = tl.dot(xt, wt, input_precision=DOT) + bias  # [BB, MP]
    c = softmax_rows(logit, m2, M)  # [BB, MP]
    act = tl.load(act_ptr + a_offs, mask=a_mask, other=0.0).to(ACC)  # [BB]
    tl.store(coef_ptr + c_offs, c, mask=c_mask)
    tl.store(mass_ptr + c_offs, c * act[:, None], mask=c_mask)


@triton.jit
def gate_backward(
    wr_ptr, coef_ptr, act_ptr, g_ptr, dl_ptr, dx_ptr, da_ptr, J, B,
    M: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr,
    NEED_L: tl.constexpr, NEED_X: tl.constexpr, NEED_A: tl.constexpr,
    I64: tl.constexpr, BB: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr,
):  # fmt: skip
    """From ``G = d loss / d mass`` (``g_ptr``): ``d act`` (``NEED_A``, into ``da_ptr``
    ``[B, J]``), ``dL`` (``NEED_L``, ``dl_ptr`` ``[J, B, m]``) and ``dX = dL W^route^T``
    (``NEED_X``, ``dx_ptr`` ``[J, B, D]``) of child ``program_id(1)`` at the program's sites."""
    b0 = tl.program_id(0) * BB
    j = tl.program_id(1)
    x_offs, x_mask, c_offs, c_mask, a_offs, a_mask, m2 = _site_tiles(
        j, b0, B, J, M, D, I64, BB, DP, MP
    )
    c = tl.load(coef_ptr + c_offs, mask=c_mask, other=0.0).to(ACC)  # [BB, MP]
    g = tl.load(g_ptr + c_offs, mask=c_mask, other=0.0).to(ACC)  # [BB, MP]
    if NEED_A:
        tl.store(da_ptr + a_offs, tl.sum(g * c, axis=1), mask=a_mask)  # [BB]
    if NEED_L or NEED_X:
        act = tl.load(act_ptr + a_offs, mask=a_mask, other=0.0).to(ACC)  # [BB]
        ga = g * act[:, None]  # [BB, MP]: d loss / d c
        dl = c * (ga - tl.sum(c * ga, axis=1)[:, None])  # [BB, MP]: softmax's backward
        if NEED_L:
            tl.store(dl_ptr + c_offs, dl, mask=c_mask)
        if NEED_X:
            wt = _route_weights(wr_ptr, j, M, D, ACC, I64, DP, MP)  # [DP, MP]
            dx = tl.dot(dl, tl.trans(wt), input_precision=DOT)  # [BB, DP]
            tl.store(dx_ptr + x_offs, dx, mask=x_mask)
