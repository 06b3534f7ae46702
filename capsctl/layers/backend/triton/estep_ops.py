"""EM routing's E-step (estep.py) as ``torch.library`` custom ops, and :func:`triton_e_step`,
the autograd function that joins them with the window sums of a conv layer.

:func:`triton_e_step` computes what capsctl/layers/routers/em/windows.py's :class:`EStep`
does, ``R[B, J, m]`` from ``quad[B, J, m]`` and ``c[B, 1, m]``, in one kernel (no ``grid``: the
softmax within each child entry) or two (a conv layer's ``grid``: each entry's max and sum of
exponentials, combined over every window the child falls in by the grid's sums on ``[B, J]``,
then ``R``). Its backward is one kernel (two with a grid: each entry's ``sum_m R G`` first).
:class:`EStep` makes eight passes over the assignment-sized tensors forward and six backward,
one torch operator each. Unlike :class:`EStep`, ``quad`` is left as it is (the result is a new
tensor, so that a first call that proves the kernels can run again on the same input).
Float32 in and out (float64 for float64 inputs, the tests').
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from capsctl.layers.backend.triton import estep
from capsctl.layers.backend.triton.ops import acc_dtype, on_device
from capsctl.layers.routers.em.windows import WindowGrid

__all__ = ["triton_e_step"]

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


class TritonEStep(torch.autograd.Function):
    """``quad[B, J, m]``, ``c[B, 1, m]`` -> ``R[B, J, m]``, the softmax of ``c - quad / 2``
    over every parent each child votes for (``grid``; its site's ``m`` parent types when None).
    Saves only ``R``."""

    @staticmethod
    def forward(ctx, quad: Tensor, c: Tensor, grid: WindowGrid | None) -> Tensor:  # type: ignore[override]
        cb = c.reshape(c.shape[0], c.shape[-1])  # [B, m]
        if grid is None:
            r = _softmax_op(quad, cb)
        else:
            zmax, esum = _stats_op(quad, cb)  # [B, J] each
            top = grid.max_overwindow_sites(zmax)  # [B, J]: the child's max over its windows
            total = grid.sum_overwindow_sites(esum * torch.exp(zmax - top))  # [B, J]
            r = _apply_op(quad, cb, top, total)  # [B, J, m]
        ctx.save_for_backward(r)
        ctx.grid = grid
        return r

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        (r,) = ctx.saved_tensors
        windows = ctx.grid is not None
        # each entry's sum R G over every window its child falls in [B, J] (not read without)
        t = ctx.grid.sum_overwindow_sites(_rowdot_op(r, g)) if windows else r.new_empty(0)
        dq, dc = _backward_op(r, g, t, windows)
        return dq, dc.unsqueeze(1), None  # [B, J, m], [B, 1, m]


def triton_e_step(quad: Tensor, c: Tensor, grid: WindowGrid | None) -> Tensor:
    """:class:`TritonEStep`: ``R[B, J, m]`` from ``quad[B, J, m]`` and ``c[B, 1, m]``."""
    out: Tensor = TritonEStep.apply(quad, c, grid)
    return out
