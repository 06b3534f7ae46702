"""Triton building blocks of the routed and the weighted pass: one child's votes at a block of
parent sites as one matrix product (``tl.dot``, tensor cores), and the tiles around it.

Letters and layouts as in capsctl/layers/passes/routed.py: child poses ``x[J, B, a, x]``,
weights ``w[J, x, m, c]``, parent-sized tensors ``[B, m, a, c]`` (parent poses, sums and their
gradients), coefficients ``r[J, B, m]``; all contiguous.

A block of ``BB`` parent sites and one child ``j`` give the vote tile

    V[(b, a), (m, c)] = sum_x X[j, b, a, x] W[j, x, m, c]      [BB*AP, MP*CP] = [R, N]

a product of the child's pose rows ``[R, KP]`` and its weights ``[KP, N]``: the rows are the
sites' pose rows ``(b, a)``, the columns the parents' pose columns ``(m, c)`` and the inner
dimension the child pose width ``x``. Every dimension is padded to a power of two (``AP``,
``MP``, ``CP``, ``KP``); the padded entries load as zero, so they add nothing to a product, and
``KP`` is at least the MMA's K (16 for 16-bit inputs, 8 for float32, 4 for float64). Viewed as
``[BB, AP, MP, CP]`` the votes meet the parent-sized tiles of the block element by element;
the agreement and the coefficients' gradient reduce it over ``(a, c)`` to ``[BB, MP]``.

Offsets are int32 unless ``I64`` (set by the launcher when a tensor has ``2**31`` elements or
more). ``ACC`` is the accumulation type (float32; float64 for float64 inputs), ``DT`` the type
the vote product reads (the inputs' own 16-bit type, else ``ACC``), ``DOT`` the input precision
of products in ``ACC`` (``"tf32x3"`` for float32: float32's accuracy from tensor cores;
``"ieee"`` for float64).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "block_origin",
    "coef_tile",
    "parent_tile",
    "pose_rows",
    "softmax_rows",
    "to_rows",
    "vote_block",
    "vote_tile",
    "weight_block",
    "widen",
]


@triton.jit
def widen(i, I64: tl.constexpr):
    """``i`` as the offsets' integer type (int64 where ``I64``)."""
    if I64:
        return i.to(tl.int64)
    return i


@triton.jit
def block_origin(M: tl.constexpr, BB: tl.constexpr, MP: tl.constexpr):
    """The first site and the first parent of the program's block of ``BB`` sites and ``MP``
    parents: ``program_id(0)`` counts the blocks of parents fastest (those of one block of
    sites run side by side and share its child poses through L2), ``cdiv(M, MP)`` of them a
    block of sites."""
    blocks: tl.constexpr = (M + MP - 1) // MP
    pid = tl.program_id(0)
    return (pid // blocks) * BB, (pid % blocks) * MP


@triton.jit
def parent_tile(b0, b_end, m0, M: tl.constexpr, A: tl.constexpr, C: tl.constexpr,
                I64: tl.constexpr, BB: tl.constexpr, AP: tl.constexpr, MB: tl.constexpr,
                CP: tl.constexpr):  # fmt: skip
    """Offsets ``[BB, AP, MB, CP]`` into a parent-sized ``T[B, m, a, c]`` at sites
    ``b0 + [0, BB)`` and parents ``m0 + [0, MB)``, and their mask (sites below ``b_end``)."""
    b4 = (b0 + tl.arange(0, BB))[:, None, None, None]
    a4 = tl.arange(0, AP)[None, :, None, None]
    m4 = (m0 + tl.arange(0, MB))[None, None, :, None]
    c4 = tl.arange(0, CP)[None, None, None, :]
    offs = ((widen(b4, I64) * M + m4) * A + a4) * C + c4  # [BB, AP, MB, CP]
    mask = (b4 < b_end) & (a4 < A) & (m4 < M) & (c4 < C)
    return offs, mask


@triton.jit
def coef_tile(j, b0, b_end, m0, B, M: tl.constexpr, I64: tl.constexpr, BB: tl.constexpr,
              MB: tl.constexpr):  # fmt: skip
    """Offsets ``[BB, MB]`` into a coefficient-sized ``T[J, B, m]`` of child ``j`` at sites
    ``b0 + [0, BB)`` and parents ``m0 + [0, MB)``, their mask (sites below ``b_end``), and the
    parent index ``m2[1, MB]``."""
    b2 = (b0 + tl.arange(0, BB))[:, None]
    m2 = (m0 + tl.arange(0, MB))[None, :]
    offs = (widen(j, I64) * B + b2) * M + m2  # [BB, MB]
    return offs, (b2 < b_end) & (m2 < M), m2


@triton.jit
def pose_rows(j, b0, b_end, B, A: tl.constexpr, XD: tl.constexpr, I64: tl.constexpr,
              BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr):  # fmt: skip
    """Offsets ``[R, KP]`` of child ``j``'s pose rows ``X[j, b, a, x]`` at sites
    ``b0 + [0, BB)`` (rows ``(b, a)``, columns ``x``) and their mask (sites below ``b_end``)."""
    rr = tl.arange(0, BB * AP)
    bb = b0 + rr // AP  # [R]: the row's site
    aa = rr % AP  # [R]: the row's pose row
    kk = tl.arange(0, KP)
    offs = (((widen(j, I64) * B + bb) * A + aa) * XD)[:, None] + kk[None, :]  # [R, KP]
    return offs, ((bb < b_end) & (aa < A))[:, None] & (kk < XD)[None, :]


@triton.jit
def weight_block(j, m0, M: tl.constexpr, C: tl.constexpr, XD: tl.constexpr, I64: tl.constexpr,
                 KP: tl.constexpr, MB: tl.constexpr, CP: tl.constexpr):  # fmt: skip
    """Child ``j``'s weights of parents ``m0 + [0, MB)``: offsets ``[KP, N]`` into
    ``W[J, x, m, c]`` (rows ``x``, columns ``(m, c)``) and their mask."""
    kk = tl.arange(0, KP)
    nn = tl.arange(0, MB * CP)
    mm = m0 + nn // CP  # [N]: the column's parent
    cc = nn % CP  # [N]: the column's pose column
    wo = ((widen(j, I64) * XD + kk) * (M * C))[:, None] + (mm * C + cc)[None, :]  # [KP, N]
    return wo, (kk < XD)[:, None] & ((mm < M) & (cc < C))[None, :]


@triton.jit
def vote_block(x_ptr, w_ptr, j, b0, b_end, B, m0, M: tl.constexpr, A: tl.constexpr,
               C: tl.constexpr, XD: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr,
               I64: tl.constexpr, BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr,
               MB: tl.constexpr, CP: tl.constexpr):  # fmt: skip
    """Child ``j``'s votes for parents ``m0 + [0, MB)`` at sites ``b0 + [0, BB)`` (below
    ``b_end``): ``V[(b, a), (m, c)]`` -> ``[BB, AP, MB, CP]`` in float32 (float64), one
    ``tl.dot``; and the product's second operand, the weights ``wt[KP, N]`` (in ``DT``)."""
    xo, xmask = pose_rows(j, b0, b_end, B, A, XD, I64, BB, KP, AP)  # [R, KP]
    xt = tl.load(x_ptr + xo, mask=xmask, other=0.0).to(DT)  # [R, KP]
    wo, wmask = weight_block(j, m0, M, C, XD, I64, KP, MB, CP)  # [KP, N]
    wt = tl.load(w_ptr + wo, mask=wmask, other=0.0).to(DT)  # [KP, N]
    v = tl.dot(xt, wt, input_precision=DOT)  # [R, N]
    return tl.reshape(v, (BB, AP, MB, CP)), wt


@triton.jit
def vote_tile(x_ptr, w_ptr, j, b0, b_end, B, M: tl.constexpr, A: tl.constexpr,
              C: tl.constexpr, XD: tl.constexpr, DT: tl.constexpr, DOT: tl.constexpr,
              I64: tl.constexpr, BB: tl.constexpr, KP: tl.constexpr, AP: tl.constexpr,
              MP: tl.constexpr, CP: tl.constexpr):  # fmt: skip
    """Child ``j``'s votes for every parent at sites ``b0 + [0, BB)`` (below ``b_end``):
    ``[BB, AP, MP, CP]`` and the weights ``wt[KP, N]`` (:func:`vote_block` from parent 0)."""
    return vote_block(x_ptr, w_ptr, j, b0, b_end, B, 0, M, A, C, XD, DT, DOT, I64, BB, KP, AP,
                      MP, CP)  # fmt: skip


@triton.jit
def to_rows(t, BB: tl.constexpr, AP: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr):
    """A vote-shaped ``[BB, AP, MP, CP]`` as the product's ``[R, N] = [(b, a), (m, c)]``."""
    return tl.reshape(t, (BB * AP, MP * CP))


@triton.jit
def softmax_rows(logit, m2, M: tl.constexpr):
    """``softmax_m`` of ``logit[BB, MP]``, the padded parents (``m2 >= M``) left out (0)."""
    logit = tl.where(m2 < M, logit, float("-inf"))
    e = tl.exp(logit - tl.max(logit, axis=1)[:, None])  # [BB, MP]
    return e / tl.sum(e, axis=1)[:, None]  # [BB, MP]
