"""Triton kernels of dynamic routing's squash (Sabour, Frosst, Hinton, NeurIPS 2017, eq. 1):
``v = s |s| / (1 + |s|^2)`` over the last dimension, forward and backward in one kernel each.

Rows ``s[R, D]`` (``R`` capsules of ``D`` entries, contiguous). A program owns ``BR`` rows:

- :func:`squash_forward`: ``n = |s|``, ``v = s f`` with ``f = n / (1 + n^2)``;
- :func:`squash_backward`: from ``G = d loss / d v``,
  ``ds = f G + s f'(n) (s . G) / n`` with ``f'(n) = (1 - n^2) / (1 + n^2)^2``; at ``s = 0``
  both terms are 0, as torch's ``vector_norm`` gradient is (0 at 0).

Sums in float32 (float64 for float64 inputs), results in the input's dtype. In torch the
squash and its gradient are a dozen elementwise operators, each a launch and a pass over
the parent poses; here they are one each. No atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["squash_backward", "squash_forward"]


@triton.jit
def _rows(R, D: tl.constexpr, I64: tl.constexpr, BR: tl.constexpr, DP: tl.constexpr):
    """Offsets ``[BR, DP]`` of the program's rows and their mask."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]  # [BR, 1]
    if I64:
        r = r.to(tl.int64)
    d = tl.arange(0, DP)[None, :]  # [1, DP]
    return r * D + d, (r < R) & (d < D)


@triton.jit
def squash_forward(s_ptr, v_ptr, R, D: tl.constexpr, ACC: tl.constexpr, I64: tl.constexpr,
                   BR: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    """``v = s |s| / (1 + |s|^2)`` of the program's rows."""
    offs, mask = _rows(R, D, I64, BR, DP)
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(ACC)  # [BR, DP]
    n2 = tl.sum(s * s, axis=1)[:, None]  # [BR, 1]
    f = tl.sqrt(n2) / (1.0 + n2)  # [BR, 1]
    tl.store(v_ptr + offs, s * f, mask=mask)


@triton.jit
def squash_backward(s_ptr, g_ptr, ds_ptr, R, D: tl.constexpr, ACC: tl.constexpr,
                    I64: tl.constexpr, BR: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    """``ds = f G + s f'(n) (s . G) / n`` of the program's rows (0 where ``s = 0``)."""
    offs, mask = _rows(R, D, I64, BR, DP)
    s = tl.load(s_ptr + offs, mask=mask, other=0.0).to(ACC)  # [BR, DP]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(ACC)  # [BR, DP]
    n2 = tl.sum(s * s, axis=1)[:, None]  # [BR, 1]
    n = tl.sqrt(n2)
    sg = tl.sum(s * g, axis=1)[:, None]  # [BR, 1]
    q = 1.0 + n2
    f = n / q
    k = tl.where(n > 0, (1.0 - n2) / (q * q * tl.where(n > 0, n, 1.0)) * sg, 0.0)  # [BR, 1]
    tl.store(ds_ptr + offs, f * g + k * s, mask=mask)
