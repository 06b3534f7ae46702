"""The reductions over a conv child's overlapping windows (overlap.py) as ``torch.library``
custom ops. ``geometry`` is ``[b, H, W, n, h, w, K, S]``: the child grid ``[b, H, W, n]``, the
output sites ``h x w``, kernel ``K`` and stride ``S`` of the window copy whose entries
``[B = b h w, J = K K n, *e]`` (``[J, B, *e]`` when ``child_major``) the ops read:

- ``capsctl::triton_overlap_reduce(src, geometry, child_major, to_grid, take_max)``: each
  child's sum (or max) over its entries, as the child grid ``[b, H, W, n, *e]``
  (``to_grid``) or written back to each of its entries (``src``'s shape);
- ``capsctl::triton_overlap_lse(zmax, esum, geometry)``: ``[B, J]`` each; every entry gets its
  child's ``log sum exp`` over all its parents.

No gradients: they serve the window copy's backward and EM routing's E-step, which have
their own. Sums in float32 (float64 for float64 inputs); results in the input's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from capsctl.layers.backend.triton import overlap
from capsctl.layers.backend.triton.ops import acc_dtype, on_device

__all__ = ["triton_overlap_lse", "triton_overlap_reduce"]

# entries a program gathers ([children, pose entries]), and its warps: 4 a thread (the
# log-sum-exp's 27 unrolled gathers held 175 registers on sm_90a at 8 a thread, and the
# window copy's bf16 gradient spilled 8 bytes there)
_ELEMENTS = 512
_WARPS = 4


def _launch(geometry: list[int], e: int, child_major: bool, numel: int) -> tuple[dict, tuple[int]]:
    """The sizes and constexprs both kernels take (entries ``e`` wide, padded to ``EP``) and
    their grid."""
    b, hh, ww, n, ho, wo, k, s = geometry
    sites, entries = b * ho * wo, k * k * n
    sb, sj = (e, sites * e) if child_major else (entries * e, e)
    children = b * hh * ww * n
    ep = triton.next_power_of_2(e)
    bc = max(1, _ELEMENTS // ep)
    big = max(numel, children * e) >= 2**31
    meta = {
        "CHILDREN": children, "H": hh, "W": ww, "N": n, "HO": ho, "WO": wo, "SB": sb, "SJ": sj,
        "K": k, "S": s, "I64": big, "BC": bc,
    }  # fmt: skip
    return meta, (triton.cdiv(children, bc),)


def _check(t: Tensor, geometry: list[int], child_major: bool) -> int:
    """The entry width ``E`` of ``t`` (``[B, J, *e]`` or ``[J, B, *e]``), checked."""
    b, _, _, n, ho, wo, k, _ = geometry
    lead = (k * k * n, b * ho * wo) if child_major else (b * ho * wo, k * k * n)
    if tuple(t.shape[:2]) != lead:
        raise ValueError(f"window entries of shape {tuple(t.shape)} do not match {geometry}")
    return math.prod(t.shape[2:])


@torch.library.custom_op("capsctl::triton_overlap_reduce", mutates_args=())
def triton_overlap_reduce(
    src: Tensor, geometry: list[int], child_major: bool, to_grid: bool, take_max: bool
) -> Tensor:
    """Each child's sum (max with ``take_max``) over its window entries (module docstring)."""
    if to_grid and take_max:
        raise ValueError("the max over windows is written back to the entries only")
    src = src.contiguous()
    e = _check(src, geometry, child_major)
    b, hh, ww, n = geometry[:4]
    out = src.new_empty(b, hh, ww, n, *src.shape[2:]) if to_grid else torch.empty_like(src)
    meta, grid = _launch(geometry, e, child_major, src.numel())
    if out.numel():
        with on_device(src):
            overlap.overlap_reduce[grid](
                src, out, **meta, E=e, EP=triton.next_power_of_2(e), MAX=take_max, TO_GRID=to_grid,
                ACC=acc_dtype(src)[1], num_warps=_WARPS,
            )  # fmt: skip
    return out


@triton_overlap_reduce.register_fake
def _(src, geometry, child_major, to_grid, take_max):  # type: ignore[no-untyped-def]
    if to_grid:
        return src.new_empty(*geometry[:4], *src.shape[2:])
    return torch.empty_like(src, memory_format=torch.contiguous_format)


@torch.library.custom_op("capsctl::triton_overlap_lse", mutates_args=())
def triton_overlap_lse(zmax: Tensor, esum: Tensor, geometry: list[int]) -> Tensor:
    """Every entry's child's ``log sum exp`` from the entries' ``zmax`` and ``esum``
    ``[B, J]`` (module docstring)."""
    zmax, esum = zmax.contiguous(), esum.contiguous()
    _check(zmax, geometry, False)
    lse = torch.empty_like(zmax)
    meta, grid = _launch(geometry, 1, False, zmax.numel())
    if lse.numel():
        with on_device(zmax):
            overlap.overlap_lse[grid](
                zmax, esum, lse, **meta, ACC=acc_dtype(zmax)[1], num_warps=_WARPS
            )  # fmt: skip
    return lse


@triton_overlap_lse.register_fake
def _(zmax, esum, geometry):  # type: ignore[no-untyped-def]
    return torch.empty_like(zmax, memory_format=torch.contiguous_format)
