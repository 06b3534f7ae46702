"""The capsules' LayerNorm over each pose (``d`` = 16 numbers), on a CPU as compiled loops.

The primary capsules of ``cifar10-caps-simple`` normalize a million poses of 16 numbers per
batch of 128. torch's CPU LayerNorm handles such short rows at a fraction of the memory's speed:
forward and backward took about 45 ms of a 355 ms training step on a 2-core Xeon. The loops of
capsctl/layers/backend/csrc/layer_norm.cpp hold a row in one vector register and need one pass
over the poses forward and one backward. Same math as :class:`torch.nn.LayerNorm` (tested
against it); used where capsctl/layers/backend/dispatch.py says ``native`` (float32 tensors on a CPU
outside tracing, ``torch.compile`` and ``use("dense")``, which export uses); elsewhere
:func:`pose_layer_norm` calls the module itself.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from capsctl.layers.backend import bindings
from capsctl.layers.backend.dispatch import autocast_dtype, choose

__all__ = ["pose_layer_norm"]

_MAX_D = 1024  # the loops' scratch per row


class _PoseLayerNorm(torch.autograd.Function):
    """``(x[R, d], w[d], b[d], eps)`` -> LayerNorm of each row; saves ``x``, the rows' means
    and reciprocal standard deviations ``[R]``."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        y, mean, rstd = bindings.layer_norm_forward(x, w, b, eps)
        ctx.save_for_backward(x, w, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w, mean, rstd = ctx.saved_tensors
        gx, gw, gb = bindings.layer_norm_backward(x, w, mean, rstd, gy, ctx.needs_input_grad[0])
        return gx, gw, gb, None


def pose_layer_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """``norm(x)`` for poses ``x[..., d]``; a :class:`torch.nn.LayerNorm` over the last
    dimension with weight and bias runs as the compiled loops where they can run. Under
    autocast, 16-bit poses run the loops in float32 and come back in their own dtype, as
    autocast's LayerNorm on a CPU returns them."""
    if (
        isinstance(norm, nn.LayerNorm)
        and len(norm.normalized_shape) == 1
        and norm.weight is not None
        and norm.bias is not None
        and x.shape[-1] <= _MAX_D
        and x.numel() > 0
        and choose(x, norm.weight, norm.bias, autocast=autocast_dtype(x)).backend == "native"
    ):
        d = x.shape[-1]
        rows = x.float().contiguous().view(-1, d)  # autocast's 16-bit poses: float32 inside
        y = _PoseLayerNorm.apply(rows, norm.weight, norm.bias, norm.eps)
        return y.view(x.shape).to(x.dtype)
    return norm(x)
