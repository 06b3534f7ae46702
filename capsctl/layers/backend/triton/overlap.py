"""Triton kernels of the reductions over a conv child's overlapping windows.

A conv capsule layer with kernel ``K`` and stride ``S`` copies its child grid ``[b, H, W, n]``
into windows: entries ``[B = (b, h, w), J = (k, l, n)]`` (capsctl/layers/baseline_capsules.py),
``h, w`` the output sites. A child ``(b, Y, X, t)`` falls in every window whose site satisfies
``Y = h S + k``, ``X = w S + l`` (up to ``K*K`` of them). Torch reduces over those entries one
kernel offset at a time (``K*K`` strided operators, or a permuted copy, ``fold`` and a window
copy back); here one program owns ``BC`` children, gathers their entries (no atomics: each
entry belongs to exactly one child) and writes each result once:

- :func:`overlap_reduce`: the sum (or the max) of each child's entries, an entry of ``E``
  values (a pose's, or 1), written to the child grid ``[b, H, W, n, E]`` (``TO_GRID``: the
  gradient of the window copy) or back to every entry of the child (each entry becomes its
  child's total, as EM routing's E-step needs);
- :func:`overlap_lse`: from each entry's ``zmax`` and ``esum = sum_m exp(z - zmax)``, the
  child's ``log sum exp(z)`` over every parent it votes for (``top + log sum esum exp(zmax -
  top)``, ``top`` the child's max), written back to each of its entries.

Entries are addressed by strides ``SB, SJ`` (``[B, J, E]``, or ``[J, B, E]`` child-major), the
last dim contiguous. Sums in float32 (float64 for float64 inputs), results in the output's
dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["overlap_lse", "overlap_reduce"]


@triton.jit
def _children(CHILDREN, H, W, N, I64: tl.constexpr, BC: tl.constexpr):
    """The program's children ``[BC, 1]``, their mask and grid coordinates ``(b, Y, X, t)``."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)[:, None]  # [BC, 1]
    if I64:
        c = c.to(tl.int64)
    t = c % N
    xx = (c // N) % W
    yy = (c // (N * W)) % H
    bb = c // (N * W * H)
    return c, c < CHILDREN, bb, yy, xx, t


@triton.jit
def _entry(bb, yy, xx, t, live, ky: tl.constexpr, kx: tl.constexpr, HO, WO, N, SB, SJ,
           K: tl.constexpr, S: tl.constexpr):  # fmt: skip
    """The offset of each child's entry at kernel offset ``(ky, kx)`` and whether it exists
    (the window's site inside the output grid)."""
    hy = yy - ky
    hx = xx - kx
    ok = live & (hy >= 0) & (hx >= 0)
    hy = tl.where(ok, hy, 0)
    hx = tl.where(ok, hx, 0)
    if S > 1:
        ok = ok & (hy % S == 0) & (hx % S == 0)
    hh = hy // S
    ww = hx // S
    ok = ok & (hh < HO) & (ww < WO)
    site = (bb * HO + hh) * WO + ww
    return site * SB + ((ky * K + kx) * N + t) * SJ, ok


@triton.jit
def overlap_reduce(src_ptr, dst_ptr, CHILDREN, H, W, N, HO, WO, SB, SJ, K: tl.constexpr,
                   S: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, MAX: tl.constexpr,
                   TO_GRID: tl.constexpr, ACC: tl.constexpr, I64: tl.constexpr,
                   BC: tl.constexpr):  # fmt: skip
    """Each child's sum (``MAX``: max) over its entries ``[BC, EP]``, to the child grid or
    back to every entry."""
    c, live, bb, yy, xx, t = _children(CHILDREN, H, W, N, I64, BC)
    e = tl.arange(0, EP)[None, :]  # [1, EP]
    emask = e < E
    acc = tl.full((BC, EP), float("-inf") if MAX else 0.0, ACC)
    for ky in tl.static_range(K):
        for kx in tl.static_range(K):
            off, ok = _entry(bb, yy, xx, t, live, ky, kx, HO, WO, N, SB, SJ, K, S)
            if MAX:
                v = tl.load(src_ptr + off + e, mask=ok & emask, other=float("-inf"))
                acc = tl.maximum(acc, v.to(ACC))
            else:
                v = tl.load(src_ptr + off + e, mask=ok & emask, other=0.0)
                acc += v.to(ACC)
    if TO_GRID:
        tl.store(dst_ptr + c * E + e, acc, mask=live & emask)
    else:
        for ky in tl.static_range(K):
            for kx in tl.static_range(K):
                off, ok = _entry(bb, yy, xx, t, live, ky, kx, HO, WO, N, SB, SJ, K, S)
                tl.store(dst_ptr + off + e, acc, mask=ok & emask)


@triton.jit
def overlap_lse(zmax_ptr, esum_ptr, lse_ptr, CHILDREN, H, W, N, HO, WO, SB, SJ,
                K: tl.constexpr, S: tl.constexpr, ACC: tl.constexpr, I64: tl.constexpr,
                BC: tl.constexpr):  # fmt: skip
    """Each child's ``log sum exp`` over all its entries' parents, to every entry of it."""
    c, live, bb, yy, xx, t = _children(CHILDREN, H, W, N, I64, BC)
    top = tl.full((BC, 1), float("-inf"), ACC)
    for ky in tl.static_range(K):
        for kx in tl.static_range(K):
            off, ok = _entry(bb, yy, xx, t, live, ky, kx, HO, WO, N, SB, SJ, K, S)
            z = tl.load(zmax_ptr + off, mask=ok, other=float("-inf")).to(ACC)
            top = tl.maximum(top, z)
    safe = tl.where(top > float("-inf"), top, 0.0)  # a child in no window: nothing to write
    total = tl.zeros((BC, 1), ACC)
    for ky in tl.static_range(K):
        for kx in tl.static_range(K):
            off, ok = _entry(bb, yy, xx, t, live, ky, kx, HO, WO, N, SB, SJ, K, S)
            z = tl.load(zmax_ptr + off, mask=ok, other=0.0).to(ACC)
            es = tl.load(esum_ptr + off, mask=ok, other=0.0).to(ACC)
            total += tl.where(ok, es * tl.exp(z - safe), 0.0)
    lse = safe + tl.log(tl.where(total > 0, total, 1.0))
    for ky in tl.static_range(K):
        for kx in tl.static_range(K):
            off, ok = _entry(bb, yy, xx, t, live, ky, kx, HO, WO, N, SB, SJ, K, S)
            tl.store(lse_ptr + off, lse, mask=ok)
