"""Layout copies of pose tensors that keep their last dim in place.

Moving a pose's rows next to the batch (capsctl/layers/capsules.py) is a permuted copy whose
innermost contiguous run is one pose row: ``x`` = 4 floats for 4x4 poses. Copied float by float,
each 16-byte run costs the general strided loop of a copy; copied as one 16-byte element (the
same bytes viewed as ``complex128``), the loop moves whole runs. Measured on this project's
2-core reference machine, a 67 MB permute of ``[b, H, W, n, a, x]`` poses (batch 128 of
``cifar10-caps-simple``'s primary capsules): 14.7 ms -> 3.8 ms one way, 7.8 ms -> 5.6 ms the
other. :func:`permute_rows` does that in both passes (autograd's own backward would copy the
gradient float by float); the bytes moved are the same, so the result is bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["permute_rows"]

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
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return t.permute(*dims).contiguous()  # export and compile see the plain op
    return _PermuteRows.apply(t, dims)
