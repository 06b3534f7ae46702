"""Layout copies of pose tensors that keep their last dim in place.

Moving a pose's rows next to the batch (capsctl/layers/capsules.py) is a permuted copy whose
innermost contiguous run is one pose row: ``x`` = 4 floats for 4x4 poses. Copied float by float,
each 16-byte run costs the general strided loop of a copy; copied as one 16-byte element (the
same bytes viewed as ``complex128``), the loop moves whole runs. Measured on this project's
2-core reference machine, a 67 MB permute of ``[b, H, W, n, a, x]`` poses (batch 128 of
``cifar10-caps-simple``'s primary capsules): 14.7 ms -> 3.8 ms one way, 7.8 ms -> 5.6 ms the
other. :func:`permute_rows` does that in both passes (autograd's own backward would copy the
gradient float by float); the bytes moved are the same, so the result is bit-exact.

A conv capsule layer's windows (every ``k x k`` window of child capsules at every output
position) are one copy of ``unfold`` views. Autograd's backward of ``unfold`` is a general
scatter: on the 2-core reference machine 31 ms for the windows of ``cifar10-caps-simple``'s
first conv capsule layer at batch 32 (``[32, 15, 15, 32, 16]`` children, 288 x 1568 windows).
:func:`window_copy` adds the gradient back one kernel offset at a time instead, ``k*k`` strided
additions of a grid-sized slice: 4.5 ms for the same windows. Where the Triton kernels run
(a GPU), one kernel gathers each child's entries instead (capsctl/layers/backend/triton/
overlap.py): one launch, not ``k*k``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from capsctl.layers.backend.dispatch import run_fused, takes_triton, tracing

__all__ = ["images_channels_last", "permute_rows", "to_channels_last", "window_copy"]

# Element types by width in bytes: a run of that many bytes moves as one element.
_BY_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


def _grouped(t: Tensor) -> Tensor:
    """``t`` with its contiguous last dim viewed as one element (or ``t`` itself)."""
    width = t.shape[-1] * t.element_size()
    wide = _BY_WIDTH.get(width)
    if wide is None or t.stride(-1) != 1 or t.dim() < 2:
        return t
    if any(s % t.shape[-1] for s in t.stride()[:-1]) or t.storage_offset() % t.shape[-1]:
        return t
    if t.data_ptr() % width:
        return t
    return t.view(wide)


def _copy(t: Tensor, dims: Sequence[int]) -> Tensor:
    g = _grouped(t)
    out = g.permute(*dims).contiguous()
    return out.view(t.dtype) if g is not t else out


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, dims: tuple[int, ...]) -> Tensor:  # type: ignore[override]
        ctx.inverse = tuple(sorted(range(len(dims)), key=lambda i: dims[i]))
        return _copy(t, dims)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _copy(grad, ctx.inverse), None


def permute_rows(t: Tensor, dims: Sequence[int]) -> Tensor:
    """``t.permute(*dims).contiguous()`` for a permutation that keeps the last dim last, copied
    in runs of the last dim in both the forward and the backward pass."""
    dims = tuple(dims)
    if dims[-1] != t.dim() - 1:
        raise ValueError(f"permute_rows keeps the last dim last, got dims {dims}")
    if tracing():
        return t.permute(*dims).contiguous()  # export and compile see the plain op
    return _PermuteRows.apply(t, dims)


def _windows(t: Tensor, kernel: int, stride: int, child_major: bool) -> Tensor:
    """The copy of :func:`window_copy` (plain ops, differentiable by autograd)."""
    b, nd = t.shape[0], t.dim()
    win = t.unfold(1, kernel, stride).unfold(2, kernel, stride)  # [b, h, w, n, *e, k, l]
    h, w = win.shape[1], win.shape[2]
    rest = tuple(range(4, nd))
    if child_major:
        win = win.permute(nd, nd + 1, 3, 0, 1, 2, *rest)  # [k, l, n, b, h, w, *e]
        return win.reshape(-1, b * h * w, *t.shape[4:])  # [J, B, *e]
    win = win.permute(0, 1, 2, nd, nd + 1, 3, *rest)  # [b, h, w, k, l, n, *e]
    return win.reshape(b * h * w, -1, *t.shape[4:])  # [B, J, *e]


def _triton_fold(grad: Tensor, *, geometry: list[int], child_major: bool) -> Tensor:
    from capsctl.layers.backend.triton.overlap_ops import triton_overlap_reduce

    return triton_overlap_reduce(grad, geometry, child_major, True, False)


class _WindowCopy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: Tensor, kernel: int, stride: int, child_major: bool) -> Tensor:  # type: ignore[override]
        ctx.shape, ctx.kernel, ctx.stride, ctx.child_major = t.shape, kernel, stride, child_major
        return _windows(t, kernel, stride, child_major)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        b, hh, ww, n = ctx.shape[:4]
        e, k, s = tuple(ctx.shape[4:]), ctx.kernel, ctx.stride
        h, w = (hh - k) // s + 1, (ww - k) // s + 1
        if takes_triton(grad):  # one gathering kernel instead of k*k launches
            call = functools.partial(
                _triton_fold, geometry=[b, hh, ww, n, h, w, k, s], child_major=ctx.child_major
            )
            folded = run_fused("overlap_sum", call, grad)
            if folded is not None:
                return folded, None, None, None
        if ctx.child_major:  # [J, B, *e] -> [k, l, n, b, h, w, *e] -> [b, h, w, k, l, n, *e]
            g = grad.reshape(k, k, n, b, h, w, *e).permute(3, 4, 5, 0, 1, 2, *range(6, 6 + len(e)))
        else:  # [B, J, *e] -> [b, h, w, k, l, n, *e]
            g = grad.reshape(b, h, w, k, k, n, *e)
        out = grad.new_zeros(ctx.shape)  # [b, H, W, n, *e]
        for i in range(k):
            for j in range(k):  # the children at offset (i, j) of every window: [b, h, w, n, *e]
                out[:, i : i + s * (h - 1) + 1 : s, j : j + s * (w - 1) + 1 : s].add_(
                    g[:, :, :, i, j]
                )
        return out, None, None, None


def window_copy(t: Tensor, kernel: int, stride: int, *, child_major: bool = False) -> Tensor:
    """Every ``kernel x kernel`` window (stride ``stride``) of a grid ``t[b, H, W, n, *e]``,
    copied: ``[B=(b,h,w), J=(k,l,n), *e]``, or ``[J, B, *e]`` with ``child_major``. The
    backward pass adds the gradient back offset by offset (see the module docstring)."""
    if tracing():
        return _windows(t, kernel, stride, child_major)  # export and compile see plain ops
    return _WindowCopy.apply(t, kernel, stride, child_major)


class _ToChannelsLast(torch.autograd.Function):
    """A channels-last copy whose gradient goes back contiguous, the layout of its input."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.contiguous(memory_format=torch.channels_last)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


def to_channels_last(x: Tensor) -> Tensor:
    """``x[b, C, H, W]`` in channels-last memory; when ``x`` is contiguous and needs a gradient,
    the gradient comes back contiguous too. Autograd's own copy hands the layer before a
    channels-last gradient, and an element-wise backward over two layouts (a ReLU's: its saved
    output contiguous, the gradient not) walks one of them out of order: 11 ms instead of 2 ms
    for the 128-channel 16x16 features of a batch of 128."""
    tracked = x.requires_grad and torch.is_grad_enabled()
    if tracked and x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last):
        out: Tensor = _ToChannelsLast.apply(x)
        return out
    return x.contiguous(memory_format=torch.channels_last)


def images_channels_last(x: Tensor) -> Tensor:
    """A batch of images ``x[b, C, H, W]`` on a CPU in channels-last memory (one small copy),
    so that every convolution after it runs channels-last: oneDNN's convolutions are faster so
    on a CPU, and the capsules read the features channels-last anyway
    (capsctl/layers/capsules.py), which otherwise copies them there forward and back. Measured
    on this project's 2-core reference machine, batch 128 training steps: ``cifar10-caps``
    1.87-1.92 s -> 1.71-1.77 s, ``cifar10-caps-simple`` 265-275 ms -> 258-268 ms (fastest of
    ten steps, alternating runs). Other devices, other shapes, tracing and ``torch.compile``
    get ``x`` as it is."""
    if x.dim() != 4 or x.device.type != "cpu":
        return x
    if tracing():
        return x
    return x.contiguous(memory_format=torch.channels_last)
