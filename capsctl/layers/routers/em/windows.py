"""A conv child's entries across every window it falls in, for EM routing's E-step.

In a conv capsule layer each child ``[b, H, W, n]`` votes at up to ``k*k`` parent sites; the
paper (Hinton, Sabour, Frosst, ICLR 2018, Procedure 1) normalizes a child's assignments over
every parent it votes for, i.e. across those sites. :class:`WindowGrid` gathers, for every
entry ``[B, J]`` of the site layout (capsctl/layers/baseline_capsules.py), a sum or a max over
all entries of the same child (one Triton kernel each where the kernels run, a GPU:
capsctl/layers/backend/triton/overlap.py); :func:`softmax_over_parents` is the softmax built
on them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from capsctl.layers.backend.dispatch import run_fused, takes_triton
from capsctl.layers.baseline_capsules import window_sites


@dataclasses.dataclass(frozen=True)
class WindowGrid:
    """Where the ``J = k*k*n`` entries of every conv site come from: child grid
    ``[b, H, W, n]``, sites ``[b, h, w]``, kernel ``k``, stride. Gathers, for every entry, a
    reduction over all entries of the same child (every window it falls in)."""

    batch: int
    height: int
    width: int
    types: int
    out_height: int
    out_width: int
    kernel: int
    stride: int

    @classmethod
    def of(cls, child_act: Tensor, kernel: int, stride: int) -> WindowGrid:
        """From the child activations ``[b, H, W, n]``."""
        b, hh, ww, n = child_act.shape
        ho, wo = (hh - kernel) // stride + 1, (ww - kernel) // stride + 1
        return cls(b, hh, ww, n, ho, wo, kernel, stride)

    @property
    def geometry(self) -> list[int]:
        """``[b, H, W, n, h, w, K, S]``, as the Triton kernels of
        capsctl/layers/backend/triton/overlap_ops.py take it."""
        return [self.batch, self.height, self.width, self.types, self.out_height,
                self.out_width, self.kernel, self.stride]  # fmt: skip

    def _gathered(self, x: Tensor, take_max: bool) -> Tensor | None:
        """Each entry's child's sum or max as one Triton kernel, where they run and no
        gradient is asked of ``x``; None where they do not (or fail: the torch code runs)."""
        if not takes_triton(x) or (torch.is_grad_enabled() and x.requires_grad):
            return None
        call = functools.partial(_triton_overlap, geometry=self.geometry, take_max=take_max)
        out: Tensor | None = run_fused("overlap_max" if take_max else "overlap_sum", call, x)
        return out

    def sum_overwindow_sites(self, x: Tensor) -> Tensor:
        """``x[B, J]`` -> ``[B, J]``: every entry becomes the sum of its child's entries."""
        fused = self._gathered(x, take_max=False)
        if fused is not None:
            return fused
        b, h, w, k, n = self.batch, self.out_height, self.out_width, self.kernel, self.types
        cols = x.reshape(b, h, w, k, k, n).permute(0, 5, 3, 4, 1, 2)  # [b, n, k, l, h, w]
        cols = cols.reshape(b, n * k * k, h * w)  # [b, (n, k, l), (h, w)]
        grid = F.fold(
            cols, (self.height, self.width), kernel_size=k, stride=self.stride
        )  # [b, n, H, W]
        return window_sites(grid.permute(0, 2, 3, 1), k, self.stride)[0]  # [B, J]

    def max_overwindow_sites(self, x: Tensor) -> Tensor:
        """``x[B, J]`` -> ``[B, J]``: every entry becomes the max of its child's entries (no
        gradient)."""
        fused = self._gathered(x, take_max=True)
        if fused is not None:
            return fused
        b, h, w, k, n, s = (
            self.batch,
            self.out_height,
            self.out_width,
            self.kernel,
            self.types,
            self.stride,
        )
        with torch.no_grad():
            win = x.reshape(b, h, w, k, k, n)  # [b, h, w, k, l, n]
            grid = x.new_full((b, self.height, self.width, n), -math.inf)  # [b, H, W, n]
            for ky in range(k):
                for kx in range(k):
                    part = grid[:, ky : ky + s * (h - 1) + 1 : s, kx : kx + s * (w - 1) + 1 : s]
                    part.copy_(torch.maximum(part, win[:, :, :, ky, kx]))  # [b, h, w, n]
            return window_sites(grid, k, s)[0]  # [B, J]


def _triton_overlap(x: Tensor, *, geometry: list[int], take_max: bool) -> Tensor:
    from capsctl.layers.backend.triton.overlap_ops import triton_overlap_reduce

    return triton_overlap_reduce(x, geometry, False, False, take_max)


def _triton_overlap_lse(zmax: Tensor, esum: Tensor, *, geometry: list[int]) -> Tensor:
    from capsctl.layers.backend.triton.overlap_ops import triton_overlap_lse

    return triton_overlap_lse(zmax, esum, geometry)


class _SoftmaxOverParents(torch.autograd.Function):
    """``z[B, m, J]`` -> ``R = exp(z) / sum exp(z)``, the sum over every entry of the same
    child (all windows it falls in, all parent types): a softmax over all the parents each
    child votes for. Stabilized by each child's maximum. Saves only ``R`` for the backward
    (``dz = R * (g - sum_child R g)``), as ``torch.softmax`` does."""

    @staticmethod
    def forward(ctx, z: Tensor, grid: WindowGrid) -> Tensor:  # type: ignore[override]
        top = grid.max_overwindow_sites(z.amax(1))  # [B, J]
        r = torch.exp(z - top.unsqueeze(1))  # [B, m, J]
        r = r / grid.sum_overwindow_sites(r.sum(1)).unsqueeze(1)  # [B, m, J]
        ctx.save_for_backward(r)
        ctx.grid = grid
        return r

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (r,) = ctx.saved_tensors
        rg = r * grad  # [B, m, J]
        total = ctx.grid.sum_overwindow_sites(rg.sum(1))  # [B, J]
        return rg - r * total.unsqueeze(1), None  # [B, m, J]


def softmax_over_parents(z: Tensor, grid: WindowGrid) -> Tensor:
    """``z[B, m, J]`` -> ``R[B, m, J]``, normalized over every parent each child votes for."""
    out: Tensor = _SoftmaxOverParents.apply(z, grid)
    return out


class EStep(torch.autograd.Function):
    """EM routing's E-step from the quadratic form of the votes, in place:
    ``quad[B, J, m]``, ``c[B, 1, m]`` -> ``R[B, J, m]`` written over ``quad``, the softmax of
    ``z = c - quad / 2`` over every parent each child votes for (``grid``; over the ``m``
    parent types of its site when ``grid`` is None). ``c`` holds the rest of
    ``log a_j + log p_ij`` (``log a_j``, the Gaussian's normalizer and the constant part of the
    quadratic form), one value per parent. Saves only ``R``; its backward is
    ``dz = R * (g - sum_child R g)``, ``dc = sum_J dz``, ``dquad = -dz / 2``. The same values
    as building ``z`` and calling :func:`softmax_over_parents` or ``torch.softmax``, without
    their assignment-sized temporaries (about 230 MB each in cifar10-em-simple's first conv
    capsule layer at batch 128). ``quad`` must be a tensor nothing else uses (the output of
    :class:`~capsctl.layers.passes.em_moments.VoteQuad`). Layout: site, child, parent type (as
    :mod:`capsctl.layers.passes.em_moments`)."""

    @staticmethod
    def forward(ctx, quad: Tensor, c: Tensor, grid: WindowGrid | None) -> Tensor:  # type: ignore[override]
        r = quad.mul_(-0.5).add_(c)  # [B, J, m]; z
        if grid is None:
            r.sub_(r.amax(-1, keepdim=True)).exp_()  # [B, J, m]
            r.div_(r.sum(-1, keepdim=True))  # [B, J, m]
        else:
            r.sub_(grid.max_overwindow_sites(r.amax(-1)).unsqueeze(-1)).exp_()  # [B, J, m]
            r.div_(grid.sum_overwindow_sites(r.sum(-1)).unsqueeze(-1))  # [B, J, m]
        ctx.mark_dirty(quad)
        ctx.save_for_backward(r)
        ctx.grid = grid
        return r

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        (r,) = ctx.saved_tensors
        dz = r * grad  # [B, J, m]
        total = dz.sum(-1)  # [B, J]
        if ctx.grid is not None:
            total = ctx.grid.sum_overwindow_sites(total)  # [B, J]
        dz.addcmul_(r, total.unsqueeze(-1), value=-1.0)  # R (g - sum_child R g)
        dc = dz.sum(1, keepdim=True)  # [B, 1, m]
        return dz.mul_(-0.5), dc, None  # [B, J, m], [B, 1, m]


def e_step(quad: Tensor, c: Tensor, grid: WindowGrid | None) -> Tensor:
    """``R[B, J, m]`` over ``quad[B, J, m]`` (consumed) and ``c[B, 1, m]`` (:class:`EStep`).
    Where the Triton kernels run (a GPU), one or two kernels forward and one or two backward
    (capsctl/layers/backend/triton/estep.py; :class:`EStep` if they fail)."""
    if takes_triton(quad, c):
        fused = run_fused("e_step", functools.partial(triton_e_step, grid=grid), quad, c)
        if fused is not None:
            return fused  # [B, J, m]
    out: Tensor = EStep.apply(quad, c, grid)
    return out


class TritonEStep(torch.autograd.Function):
    """:class:`EStep` as the Triton kernels of capsctl/layers/backend/triton/estep.py (a GPU, or
    Triton's interpreter): ``quad[B, J, m]``, ``c[B, 1, m]`` -> ``R[B, J, m]``, ``quad`` left as
    it is. Without a grid one kernel each way; with one, each entry's max and sum of
    exponentials, combined over every window its child falls in here (``[B, J]``), then ``R``;
    backward, each entry's ``sum R G`` summed over windows here, then the gradients. Saves
    only ``R``."""

    @staticmethod
    def forward(ctx, quad: Tensor, c: Tensor, grid: WindowGrid | None) -> Tensor:  # type: ignore[override]
        from capsctl.layers.backend.triton import estep_ops

        cb = c.reshape(c.shape[0], c.shape[-1])  # [B, m]
        if grid is None:
            r = estep_ops.estep_softmax(quad, cb)  # [B, J, m]
        else:
            zmax, esum = estep_ops.estep_stats(quad, cb)  # [B, J] each
            top = grid.max_overwindow_sites(zmax)  # [B, J]: the child's max over its windows
            total = grid.sum_overwindow_sites(esum * torch.exp(zmax - top))  # [B, J]
            r = estep_ops.estep_apply(quad, cb, top, total)  # [B, J, m]
        ctx.save_for_backward(r)
        ctx.grid = grid
        return r

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        from capsctl.layers.backend.triton import estep_ops

        (r,) = ctx.saved_tensors
        grid = ctx.grid
        # each entry's sum R G over every window its child falls in [B, J] (not read without)
        t = (
            r.new_empty(0)
            if grid is None
            else grid.sum_overwindow_sites(estep_ops.estep_rowdot(r, g))
        )
        dq, dc = estep_ops.estep_backward(r, g, t, grid is not None)
        return dq, dc.unsqueeze(1), None  # [B, J, m], [B, 1, m]


def triton_e_step(quad: Tensor, c: Tensor, grid: WindowGrid | None) -> Tensor:
    """``R[B, J, m]`` from ``quad[B, J, m]`` (kept) and ``c[B, 1, m]`` (:class:`TritonEStep`)."""
    out: Tensor = TritonEStep.apply(quad, c, grid)
    return out


def _child_normalizer(zmax: Tensor, esum: Tensor, grid: WindowGrid | None) -> Tensor:
    """``log sum exp(z)`` over every parent a child votes for, at each of its entries
    ``[B, J]``, from each entry's ``zmax[B, J]`` and ``esum = sum_m exp(z - zmax)``."""
    if grid is None:
        return zmax + torch.log(esum)  # [B, J]
    if takes_triton(zmax):
        call = functools.partial(_triton_overlap_lse, geometry=grid.geometry)
        fused = run_fused("overlap_lse", call, zmax, esum)  # one kernel for all of the below
        if fused is not None:
            return fused
    top = grid.max_overwindow_sites(zmax)  # [B, J]: the child's max over its windows
    total = grid.sum_overwindow_sites(esum * torch.exp(zmax - top))  # [B, J]
    return top + torch.log(total)  # [B, J]


class TritonEStepMoments(torch.autograd.Function):
    """An E-step and the next M-step's moments as the Triton kernels of
    capsctl/layers/backend/triton/em_estep.py (a GPU, or Triton's interpreter), the assignments
    never stored: ``(q, p[B, m, a, c], c[B, m], act[B, J], x[J, B, a, x], w[J, x, m, c],
    shift[B, m, a, c], grid)`` -> ``(S[2, B, m, a, c], mass[B, m])`` (``S`` holding ``S1,
    S2``), the values of
    :class:`EStep` on the quadratic form ``sum_{a,c} (q U + p U^2)`` followed by the moments
    ``sum_J R act (U, U^2)`` and ``sum_J R act``. Forward: each entry's max and sum of
    exponentials, combined here over every window its child falls in into the child's
    normalizer ``lse[B, J]``, then the moments with ``R`` built on chip. Backward: each entry's
    ``T = sum_m R g act`` (``g`` the gradient reaching ``R act``), summed over windows here,
    then the gradients. Saves the inputs and ``lse``. A given ``lse`` (with ``q = p = c = 0``:
    the first M-step's uniform assignments ``exp(-lse)``) skips the statistics."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        p: Tensor,
        c: Tensor,
        act: Tensor,
        x: Tensor,
        w: Tensor,
        shift: Tensor,
        grid: WindowGrid | None,
        lse: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        from capsctl.layers.backend.triton import estep_moments_ops as ops

        tiling = [0, 0]
        if lse is None:
            zmax, esum = ops.triton_em_estep_stats(q, p, c, x, w, shift, tiling)  # [B, J] each
            lse = _child_normalizer(zmax, esum, grid)  # [B, J]
        s, mass = ops.triton_em_estep_moments(q, p, c, lse, act, x, w, shift, tiling)
        ctx.save_for_backward(q, p, c, lse, act, x, w, shift)
        ctx.grid = grid
        return s, mass

    @staticmethod
    @once_differentiable
    def backward(ctx, gs: Tensor, gm: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        from capsctl.layers.backend.triton import estep_moments_ops as ops

        q, p, c, lse, act, x, w, shift = ctx.saved_tensors
        n = ctx.needs_input_grad
        g1, g2 = (torch.zeros_like(shift),) * 2 if gs is None else gs.unbind(0)
        gm = torch.zeros_like(c) if gm is None else gm
        tiling = [0, 0]
        t, dact = ops.triton_em_estep_rowdot(q, p, c, lse, act, x, w, shift, g1, g2, gm, tiling)
        tc = t if ctx.grid is None else ctx.grid.sum_overwindow_sites(t)  # [B, J]
        needs = [n[0] or n[1] or n[2], n[4], n[5]]
        dq, dp, dc, dx, dw = ops.triton_em_estep_grads(
            q, p, c, lse, act, x, w, shift, g1, g2, gm, tc, needs, tiling
        )
        grads = (dq, dp, dc, dact, dx, dw)
        keep = (n[0], n[1], n[2], n[3], n[4], n[5])
        return (*(g if k else None for g, k in zip(grads, keep, strict=True)), None, None, None)


def triton_e_then_moments(
    q: Tensor,
    p: Tensor,
    c: Tensor,
    act: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    grid: WindowGrid | None,
    lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:class:`TritonEStepMoments`: ``(S[2, B, m, a, c], mass[B, m])``."""
    out: tuple[Tensor, Tensor] = TritonEStepMoments.apply(q, p, c, act, x, w, shift, grid, lse)
    return out
