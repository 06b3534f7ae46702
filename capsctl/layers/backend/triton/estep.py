"""Triton kernels of EM routing's E-step (Hinton, Sabour, Frosst, ICLR 2018, Procedure 1):
the assignments ``R`` as a softmax of ``z = c - quad / 2`` over every parent a child votes for,
and its backward, each a pass or two over the assignment-sized tensors.

Layouts as capsctl/layers/routers/em/windows.py's :class:`EStep`: ``quad[B, J, m]`` (the
quadratic form of the votes; site, child, parent type), ``c[B, m]`` (the rest of
``log a_j + log p_ij``, one value per parent), per-entry reductions ``[B, J]``; all contiguous.
A row is one child entry ``(b, j)``, its ``m`` parent types.

- :func:`estep_forward` (grid: row blocks). ``MODE`` 0: the softmax within the row (an FC
  layer, or a conv layer whose child normalizes at one site), ``R`` stored. ``MODE`` 1: the
  row's max ``z_max`` and ``sum_m exp(z - z_max)`` stored, for the caller to combine over
  every window the child falls in (``top``, ``total``). ``MODE`` 2: ``R = exp(z - top) /
  total`` stored.
- :func:`estep_rowdot` (grid: row blocks): ``sum_m R G`` per row, for the caller to sum over
  windows.
- :func:`estep_backward` (grid: sites). A program owns one site ``b`` and loops over its
  children in blocks of ``BJ`` rows: ``dz = R (G - t)`` with ``t`` the row's ``sum R G``
  (computed here when ``WINDOWS`` is off, else read: summed over windows), ``d quad = -dz / 2``
  stored, ``dc[b] = sum_j dz`` kept in registers and stored once. No atomics.

Sums in ``ACC``: float32 (EM keeps float32 under autocast; float64 for float64 inputs), padded
parents masked (``MP`` a power of two), int64 offsets only where a tensor has ``2**31``
elements or more (``I64``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["estep_backward", "estep_forward", "estep_rowdot"]


@triton.jit
def _row_tile(r0, R, M: tl.constexpr, I64: tl.constexpr, BR: tl.constexpr, MP: tl.constexpr):
    """Rows ``r0 + [0, BR)``: offsets ``[BR, MP]`` into ``[rows, m]``, their mask, the row
    indices ``[BR]`` (their mask) and the parent index ``[1, MP]``."""
    rows = r0 + tl.arange(0, BR)
    if I64:
        rows = rows.to(tl.int64)
    m2 = tl.arange(0, MP)[None, :]
    offs = rows[:, None] * M + m2  # [BR, MP]
    return offs, (rows[:, None] < R) & (m2 < M), rows, rows < R, m2


@triton.jit
def estep_forward(
    q_ptr, c_ptr, top_ptr, total_ptr, r_ptr, R, J,
    M: tl.constexpr, MODE: tl.constexpr, ACC: tl.constexpr, I64: tl.constexpr,
    BR: tl.constexpr, MP: tl.constexpr,
):  # fmt: skip
    """``z = c - quad / 2`` of the program's rows; ``MODE`` 0: ``R = softmax_m(z)``; 1: the
    row's max and ``sum exp(z - max)`` (into ``top_ptr``, ``total_ptr``); 2: ``R = exp(z -
    top) / total`` (``R`` into ``r_ptr``)."""
    offs, mask, rows, rmask, m2 = _row_tile(tl.program_id(0) * BR, R, M, I64, BR, MP)
    site = rows // J  # [BR]: the row's site b
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(ACC)  # [BR, MP]
    c = tl.load(c_ptr + site[:, None] * M + m2, mask=mask, other=0.0).to(ACC)
    z = tl.where(mask, c - 0.5 * q, float("-inf"))  # [BR, MP]
    if MODE == 2:
        top = tl.load(top_ptr + rows, mask=rmask, other=0.0)  # [BR]
        total = tl.load(total_ptr + rows, mask=rmask, other=1.0)  # [BR]
        tl.store(r_ptr + offs, tl.exp(z - top[:, None]) / total[:, None], mask=mask)
    else:
        zmax = tl.max(z, axis=1)  # [BR]
        zmax = tl.where(rmask, zmax, 0.0)  # rows past the end: no inf - inf
        e = tl.exp(z - zmax[:, None])  # [BR, MP], 0 at padded parents
        esum = tl.where(rmask, tl.sum(e, axis=1), 1.0)  # [BR]; rows past the end: no 0 / 0
        if MODE == 0:
            tl.store(r_ptr + offs, e / esum[:, None], mask=mask)
        else:
            tl.store(top_ptr + rows, zmax, mask=rmask)
            tl.store(total_ptr + rows, esum, mask=rmask)


@triton.jit
def estep_rowdot(r_ptr, g_ptr, t_ptr, R, M: tl.constexpr, ACC: tl.constexpr,
                 I64: tl.constexpr, BR: tl.constexpr, MP: tl.constexpr):  # fmt: skip
    """``sum_m R G`` of the program's rows, into ``t_ptr`` ``[rows]``."""
    offs, mask, rows, rmask, _ = _row_tile(tl.program_id(0) * BR, R, M, I64, BR, MP)
    r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(ACC)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
    tl.store(t_ptr + rows, tl.sum(r * g, axis=1), mask=rmask)


@triton.jit
def estep_backward(
    r_ptr, g_ptr, t_ptr, dq_ptr, dc_ptr, J,
    M: tl.constexpr, WINDOWS: tl.constexpr, ACC: tl.constexpr, I64: tl.constexpr,
    BJ: tl.constexpr, MP: tl.constexpr,
):  # fmt: skip
    """Site ``program_id(0)``: ``dz = R (G - t)`` over its children, ``d quad = -dz / 2``
    stored, ``dc[b] = sum_j dz`` stored once."""
    b = tl.program_id(0)
    if I64:
        b = b.to(tl.int64)
    m2 = tl.arange(0, MP)[None, :]
    dc = tl.zeros((MP,), dtype=ACC)
    for j0 in range(0, J, BJ):
        jj = j0 + tl.arange(0, BJ)  # [BJ]
        rows = b * J + jj  # [BJ]
        offs = rows[:, None] * M + m2  # [BJ, MP]
        mask = (jj[:, None] < J) & (m2 < M)
        r = tl.load(r_ptr + offs, mask=mask, other=0.0).to(ACC)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)
        if WINDOWS:  # noqa: SIM108 - a constexpr branch, compiled out
            t = tl.load(t_ptr + rows, mask=jj < J, other=0.0)  # [BJ]
        else:
            t = tl.sum(r * g, axis=1)  # [BJ]
        dz = r * (g - t[:, None])  # [BJ, MP]
        tl.store(dq_ptr + offs, -0.5 * dz, mask=mask)
        dc += tl.sum(dz, axis=0)
    tl.store(dc_ptr + b * M + tl.arange(0, MP), dc, mask=tl.arange(0, MP) < M)
