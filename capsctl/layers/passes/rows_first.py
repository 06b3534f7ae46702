"""4x4 matrix poses held rows-first, and the capsules' LayerNorm that reads one layout and
writes the other.

A grid of 4x4 poses has two layouts here (letters as in capsctl/layers/passes/routed.py):

- standard ``[b, *grid, n, d]``: each pose's 16 numbers together (capsctl/layers/capsules.py);
- rows-first ``[b, a, *grid, n, x]``: the pose row ``a`` next to the batch, what a conv capsule
  layer's uniform pass reads and writes (one convolution over every pose row,
  :meth:`~capsctl.layers.capsules.ConvCapsules.uniform_sum`).

Between the two is a copy of every pose, forward and backward: 67 MB each way for the primary
capsules of ``cifar10-caps-simple`` at batch 128. The LayerNorm after each capsule layer reads
and writes every pose anyway, so its compiled loops (capsctl/layers/backend/csrc/layer_norm.cpp)
read one layout and write the other in the same pass, and the copies disappear: the inverted
dot-product attention schedule (capsctl/layers/routers/idpa.py) keeps the poses rows-first between
the layers whose only readers are uniform passes. Same math, same numbers as the standard layout's
LayerNorm (tested against :class:`torch.nn.LayerNorm`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from capsctl.layers.backend import bindings
from capsctl.layers.backend.dispatch import autocast_dtype, choose
from capsctl.layers.passes.layout import permute_rows
from capsctl.layers.passes.pose_norm import pose_layer_norm

__all__ = ["layout_layer_norm", "rows_shape", "standard_shape", "to_rows", "to_standard"]

SIDE = 4  # a = x = 4: the compiled loops' poses (d = 16)
_BLOCK = 16  # capsules per block of the loops


def rows_shape(shape: Sequence[int], rows: int) -> tuple[int, ...]:
    """``[b, *grid, n, a*x]`` -> ``[b, a, *grid, n, x]`` for poses of ``a = rows`` rows."""
    return (shape[0], rows, *shape[1:-1], shape[-1] // rows)


def standard_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """``[b, a, *grid, n, x]`` -> ``[b, *grid, n, a*x]``."""
    return (shape[0], *shape[2:-1], shape[1] * shape[-1])


def to_rows(t: Tensor, rows: int) -> Tensor:
    """Standard ``[b, *grid, n, d]`` -> a rows-first copy ``[b, a, *grid, n, x]``."""
    k = t.dim()
    split = t.reshape(*t.shape[:-1], rows, t.shape[-1] // rows)  # [b, *grid, n, a, x]
    return permute_rows(split, (0, k - 1, *range(1, k - 1), k))  # [b, a, *grid, n, x]


def to_standard(t: Tensor) -> Tensor:
    """Rows-first ``[b, a, *grid, n, x]`` -> a standard copy ``[b, *grid, n, a*x]``."""
    k = t.dim()
    out = permute_rows(t, (0, *range(2, k - 1), 1, k - 1))  # [b, *grid, n, a, x]
    return out.reshape(standard_shape(t.shape))  # [b, *grid, n, d]


class _LayoutLayerNorm(torch.autograd.Function):
    """``x`` (standard or rows-first, contiguous; ``sites`` capsules per batch element) ->
    the LayerNorm of each pose in the other (or the same) layout; saves ``x``, the poses' means
    and reciprocal standard deviations."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, w: Tensor, b: Tensor, eps: float, sites: int, rows_in: bool, rows_out: bool
    ) -> Tensor:
        shape = x.shape
        if rows_in != rows_out:
            shape = torch.Size(standard_shape(shape) if rows_in else rows_shape(shape, SIDE))
        layout = (sites, int(rows_in), int(rows_out))
        y, mean, rstd = bindings.layer_norm_forward_layout(x, w, b, eps, shape, layout, _BLOCK)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.layout = layout
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w, mean, rstd = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        gx, gw, gb = bindings.layer_norm_backward_layout(
            x, w, mean, rstd, gy, need_x, ctx.layout, _BLOCK
        )
        return gx, gw, gb, None, None, None, None


def _compiled(x: Tensor, norm: nn.Module, sites: int, rows: int, d: int) -> bool:
    return (
        rows == SIDE
        and d == SIDE * SIDE
        and isinstance(norm, nn.LayerNorm)
        and tuple(norm.normalized_shape) == (d,)
        and norm.weight is not None
        and norm.bias is not None
        and sites % _BLOCK == 0
        and x.numel() > 0
        and choose(x, norm.weight, norm.bias, autocast=autocast_dtype(x)).backend == "native"
    )


def layout_layer_norm(
    x: Tensor, norm: nn.Module, *, rows_in: bool, rows_out: bool, rows: int
) -> Tensor:
    """``norm`` over each pose of ``x`` (rows-first ``[b, a, *grid, n, x]`` if ``rows_in``, else
    standard ``[b, *grid, n, d]``; ``a = rows``), returned rows-first if ``rows_out``, else
    standard.

    One pass of the compiled loops where they run (4x4 poses, a LayerNorm with weight and bias,
    float32 on a CPU, sites a multiple of 16); elsewhere the layout copies around
    :func:`~capsctl.layers.passes.pose_norm.pose_layer_norm`."""
    sites = math.prod(x.shape[2:-1] if rows_in else x.shape[1:-1])
    d = x.shape[1] * x.shape[-1] if rows_in else x.shape[-1]
    if _compiled(x, norm, sites, rows, d):
        # autocast's 16-bit poses: float32 inside, their own dtype out (as pose_layer_norm)
        out: Tensor = _LayoutLayerNorm.apply(
            x.float().contiguous(), norm.weight, norm.bias, norm.eps, sites, rows_in, rows_out
        )
        return out.to(x.dtype)
    y = pose_layer_norm(to_standard(x) if rows_in else x, norm)
    return to_rows(y, rows) if rows_out else y
