"""Votes as rank-one updates on float32 registers: the helpers of the kernels that keep the
first design (gated.py, em.py) until they are redesigned as kernels.py and tiles.py are.

Layouts of capsctl/layers/passes/routed.py: child poses ``x[J, B, a, x]``, weights
``w[J, x, m, c]``, parent-sized ``[B, m, a, c]``, coefficient-sized ``[J, B, m]``. A program
owns a tile of ``BJ`` children and builds the tile's votes ``V[BJ, m, a, c]`` at one site as
``XD`` rank-one updates (the child pose column times the weight row). Block edges (``BM``,
``BA``, ``BC``: powers of two at least ``m``, ``a``, ``c``) are masked; padded entries load as
zero. ``ACC`` is the accumulation type.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "add_site",
    "coef_offs",
    "load_site",
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
    tl.atomic_add(ptr + offs, part, mask=(m3 < M) & (a3 < A) & (c3 < C), sem="relaxed")


@triton.jit
def coef_offs(j0, b, B, M, BJ: tl.constexpr, BM: tl.constexpr):
    """Offsets ``[BJ, BM]`` into a coefficient-sized ``T[J, B, m]`` at site ``b``, and ``m``."""
    j2 = (j0 + tl.arange(0, BJ)).to(tl.int64)[:, None]
    m2 = tl.arange(0, BM)[None, :]
    return (j2 * B + b) * M + m2, j2, m2
