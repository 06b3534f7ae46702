"""Dynamic routing's squash (squash.py) as the ``torch.library`` custom op
``capsctl::triton_squash``: ``v = s |s| / (1 + |s|^2)`` over the last dimension of ``s`` (any
leading shape), differentiable, one kernel forward and one backward (torch's expression is a
dozen elementwise operators). Sums in float32 (float64 for float64 inputs); the result has
the input's dtype.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from capsctl.layers.backend.triton import squash
from capsctl.layers.backend.triton.ops import acc_dtype, on_device

__all__ = ["triton_squash"]

# entries of s a program owns (rows of BR capsules)
_ELEMENTS = 2048
_WARPS = 4


def _meta(s: Tensor) -> tuple[dict, tuple[int]]:
    """The kernels' constexprs and grid for ``s[..., D]``."""
    d = s.shape[-1]
    rows = s.numel() // d
    dp = triton.next_power_of_2(d)
    br = max(1, _ELEMENTS // dp)
    meta = {"D": d, "ACC": acc_dtype(s)[1], "I64": s.numel() >= 2**31, "BR": br, "DP": dp}
    return meta, (triton.cdiv(rows, br),)


@torch.library.custom_op("capsctl::triton_squash", mutates_args=())
def _squash_op(s: Tensor) -> Tensor:
    s = s.contiguous()
    v = torch.empty_like(s)
    if s.numel():
        meta, grid = _meta(s)
        with on_device(s):
            squash.squash_forward[grid](s, v, s.numel() // s.shape[-1], **meta, num_warps=_WARPS)
    return v


@_squash_op.register_fake
def _(s: Tensor) -> Tensor:
    return torch.empty_like(s, memory_format=torch.contiguous_format)


@torch.library.custom_op("capsctl::triton_squash_backward", mutates_args=())
def _squash_bwd_op(s: Tensor, g: Tensor) -> Tensor:
    s, g = s.contiguous(), g.contiguous()
    ds = torch.empty_like(s)
    if s.numel():
        meta, grid = _meta(s)
        with on_device(s):
            squash.squash_backward[grid](
                s, g, ds, s.numel() // s.shape[-1], **meta, num_warps=_WARPS
            )  # fmt: skip
    return ds


@_squash_bwd_op.register_fake
def _(s: Tensor, g: Tensor) -> Tensor:
    return torch.empty_like(s, memory_format=torch.contiguous_format)


def _squash_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0])


def _squash_grad(ctx, g: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
    (s,) = ctx.saved_tensors
    return _squash_bwd_op(s, g)


_squash_op.register_autograd(_squash_grad, setup_context=_squash_setup)


def triton_squash(s: Tensor) -> Tensor:
    """``s |s| / (1 + |s|^2)`` over the last dimension, as the op ``capsctl::triton_squash``."""
    return _squash_op(s)
