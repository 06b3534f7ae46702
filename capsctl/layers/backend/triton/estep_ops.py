"""EM routing's E-step (estep.py) as ``torch.library`` custom ops: the pieces of
capsctl/layers/routers/em/windows.py's :class:`~capsctl.layers.routers.em.windows.TritonEStep`,
which joins them with a conv layer's window sums.

``R[B, J, m]`` from ``quad[B, J, m]`` and ``c[B, m]`` in one kernel (:func:`estep_softmax`:
the softmax within each child entry) or two (:func:`estep_stats`, each entry's max and sum of
exponentials, which the caller combines over every window the child falls in on ``[B, J]``,
then :func:`estep_apply`); the backward in one kernel (:func:`estep_backward`) or two (each
entry's ``sum_m R G`` first, :func:`estep_rowdot`, summed over windows by the caller). The
torch E-step makes eight passes over the assignment-sized tensors forward and six backward,
one operator each. ``quad`` is left as it is (each result is a new tensor). Float32 in and out
(float64 for float64 inputs, the tests').
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from capsctl.layers.backend.triton import estep
from capsctl.layers.backend.triton.ops import acc_dtype, on_device

__all__ = ["estep_apply", "estep_backward", "estep_rowdot", "estep_softmax", "estep_stats"]

# entries a row-wise program owns (rows of m parent types), and rows a backward program loads
# at once
_ELEMENTS = 2048
_WARPS = 4


def _rows_meta(q: Tensor) -> tuple[dict, tuple[int], int]:
    """Constexprs, grid and row count of the row-wise kernels over ``q[B, J, m]``."""
    m = q.shape[-1]
    rows = q.numel() // m
    mp = triton.next_power_of_2(m)
    br = max(1, _ELEMENTS // mp)
    meta = {"M": m, "ACC": acc_dtype(q)[1], "I64": q.numel() >= 2**31, "BR": br, "MP": mp}
    return meta, (triton.cdiv(rows, br),), rows


def _forward(q: Tensor, c: Tensor, top: Tensor, total: Tensor, mode: int) -> tuple[Tensor, ...]:
    q, c, top, total = (t.contiguous() for t in (q, c, top, total))
    bsz, j, m = q.shape
    meta, grid, rows = _rows_meta(q)
    if mode == 1:
        zmax, esum = q.new_empty(bsz, j), q.new_empty(bsz, j)  # [B, J] each
        r = q  # not written
    else:
        r = torch.empty_like(q)  # [B, J, m]
        zmax, esum = top, total  # read (mode 2) or not read (mode 0)
    if rows:
        with on_device(q):
            estep.estep_forward[grid](
                q, c, zmax, esum, r, rows, j, MODE=mode, **meta, num_warps=_WARPS
            )  # fmt: skip
    return (zmax, esum) if mode == 1 else (r,)


@torch.library.custom_op("capsctl::triton_estep_softmax", mutates_args=())
def _softmax_op(q: Tensor, c: Tensor) -> Tensor:
    return _forward(q, c, q, q, 0)[0]


@_softmax_op.register_fake
def _(q: Tensor, c: Tensor) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("capsctl::triton_estep_stats", mutates_args=())
def _stats_op(q: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    zmax, esum = _forward(q, c, q, q, 1)
    return zmax, esum


@_stats_op.register_fake
def _(q: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape[:2]), q.new_empty(q.shape[:2])


@torch.library.custom_op("capsctl::triton_estep_apply", mutates_args=())
def _apply_op(q: Tensor, c: Tensor, top: Tensor, total: Tensor) -> Tensor:
    return _forward(q, c, top, total, 2)[0]


@_apply_op.register_fake
def _(q: Tensor, c: Tensor, top: Tensor, total: Tensor) -> Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("capsctl::triton_estep_rowdot", mutates_args=())
def _rowdot_op(r: Tensor, g: Tensor) -> Tensor:
    r, g = r.contiguous(), g.contiguous()
    meta, grid, rows = _rows_meta(r)
    t = r.new_empty(r.shape[:2])  # [B, J]
    if rows:
        with on_device(r):
            estep.estep_rowdot[grid](r, g, t, rows, **meta, num_warps=_WARPS)
    return t


@_rowdot_op.register_fake
def _(r: Tensor, g: Tensor) -> Tensor:
    return r.new_empty(r.shape[:2])


@torch.library.custom_op("capsctl::triton_estep_backward", mutates_args=())
def _backward_op(r: Tensor, g: Tensor, t: Tensor, windows: bool) -> tuple[Tensor, Tensor]:
    r, g, t = r.contiguous(), g.contiguous(), t.contiguous()
    bsz, j, m = r.shape
    dq = torch.empty_like(r)  # [B, J, m]
    dc = r.new_empty(bsz, m)  # [B, m]
    mp = triton.next_power_of_2(m)
    meta = {"M": m, "ACC": acc_dtype(r)[1], "I64": r.numel() >= 2**31}
    meta |= {"BJ": max(1, _ELEMENTS // mp), "MP": mp}
    if r.numel():
        with on_device(r):
            estep.estep_backward[(bsz,)](
                r, g, t, dq, dc, j, WINDOWS=windows, **meta, num_warps=_WARPS
            )  # fmt: skip
    else:
        dc.zero_()
    return dq, dc


@_backward_op.register_fake
def _(r: Tensor, g: Tensor, t: Tensor, windows: bool) -> tuple[Tensor, Tensor]:
    return torch.empty_like(r, memory_format=torch.contiguous_format), r.new_empty(
        r.shape[0], r.shape[2]
    )


def estep_softmax(q: Tensor, c: Tensor) -> Tensor:
    """``R[B, J, m] = softmax_m(c - q / 2)`` within each entry (``c[B, m]``)."""
    return _softmax_op(q, c)


def estep_stats(q: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Each entry's ``max_m z`` and ``sum_m exp(z - max)``, ``[B, J]`` each."""
    return _stats_op(q, c)


def estep_apply(q: Tensor, c: Tensor, top: Tensor, total: Tensor) -> Tensor:
    """``R[B, J, m] = exp(z - top) / total`` (``top``, ``total``: ``[B, J]``)."""
    return _apply_op(q, c, top, total)


def estep_rowdot(r: Tensor, g: Tensor) -> Tensor:
    """Each entry's ``sum_m R G``, ``[B, J]``."""
    return _rowdot_op(r, g)


def estep_backward(r: Tensor, g: Tensor, t: Tensor, windows: bool) -> tuple[Tensor, Tensor]:
    """``d quad[B, J, m] = -R (G - t) / 2`` and ``dc[B, m] = sum_J R (G - t)``, with ``t`` each
    entry's ``sum R G`` (``windows``: read from ``t[B, J]``, summed over windows; else
    computed in the kernel)."""
    return _backward_op(r, g, t, windows)
