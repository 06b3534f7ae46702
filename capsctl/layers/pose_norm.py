"""The capsules' LayerNorm over each pose (``d`` = 16 numbers), on a CPU as compiled loops.

The primary capsules of ``cifar10-caps-simple`` normalize a million poses of 16 numbers per
batch of 128. torch's CPU LayerNorm handles such short rows at a fraction of the memory's speed:
forward and backward took about 45 ms of a 355 ms training step on a 2-core Xeon. The loops of
capsctl/layers/layer_norm.cpp hold a row in one vector register and need one pass over the
poses forward and one backward. Same math as :class:`torch.nn.LayerNorm` (tested against it);
used for float32 tensors on a CPU outside tracing, ``torch.compile`` and
:func:`~capsctl.layers.routing.dense_routing` (which export uses), where :func:`pose_layer_norm`
calls the module itself.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from capsctl.layers import native
from capsctl.layers.chunks import run_spans, site_spans, site_workers
from capsctl.layers.routing import _DENSE

__all__ = ["pose_layer_norm"]

# rows per thread's share below which one thread does all (splitting costs more than it saves)
_MIN_ROWS_PER_THREAD = 4096
_MAX_D = 1024  # the loops' scratch per row


def _spans(rows: int, like: Tensor, block: int = 1) -> list[tuple[int, int]]:
    """One span of rows per thread, each a whole number of ``block`` rows."""
    workers = max(1, min(site_workers(like), rows // _MIN_ROWS_PER_THREAD))
    per = -(-rows // workers)
    return site_spans(rows, -(-per // block) * block, workers)


class _PoseLayerNorm(torch.autograd.Function):
    """``(x[R, d], w[d], b[d], eps)`` -> LayerNorm of each row; saves ``x``, the rows' means
    and reciprocal standard deviations ``[R]``."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        rows, d = x.shape
        w, b = w.contiguous(), b.contiguous()
        y, mean, rstd = torch.empty_like(x), x.new_empty(rows), x.new_empty(rows)
        fn = native.library().capsctl_layer_norm_forward
        ptrs = [t.data_ptr() for t in (x, w, b, y, mean, rstd)]

        def part(_: int, r0: int, r1: int) -> None:
            fn(*ptrs, d, eps, r0, r1)

        run_spans(part, _spans(rows, x))
        ctx.save_for_backward(x, w, mean, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w, mean, rstd = ctx.saved_tensors
        rows, d = x.shape
        gy = gy.contiguous()
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        spans = _spans(rows, x)
        accs = [x.new_zeros(2, d, dtype=torch.float64) for _ in spans]  # [gw; gb] per thread
        fn = native.library().capsctl_layer_norm_backward
        ptrs = [t.data_ptr() for t in (x, w, mean, rstd, gy)]
        gx_ptr = None if gx is None else gx.data_ptr()

        def part(i: int, r0: int, r1: int) -> None:
            fn(*ptrs, gx_ptr, accs[i].data_ptr(), d, r0, r1)

        run_spans(part, spans)
        acc = torch.stack(accs).sum(0).to(x.dtype)  # [2, d], threads added in a fixed order
        return gx, acc[0], acc[1], None


def pose_layer_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """``norm(x)`` for poses ``x[..., d]``; a :class:`torch.nn.LayerNorm` over the last
    dimension with weight and bias runs as the compiled loops where they can run."""
    if (
        isinstance(norm, nn.LayerNorm)
        and len(norm.normalized_shape) == 1
        and norm.weight is not None
        and norm.bias is not None
        and x.shape[-1] <= _MAX_D
        and x.numel() > 0
        and not _DENSE["on"]
        and native.usable(x, norm.weight, norm.bias)
    ):
        d = x.shape[-1]
        y = _PoseLayerNorm.apply(x.contiguous().view(-1, d), norm.weight, norm.bias, norm.eps)
        return y.view(x.shape)
    return norm(x)
