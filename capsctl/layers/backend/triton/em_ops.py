"""EM routing's moments and quadratic form (em.py) as ``torch.library`` custom ops.

- ``capsctl::triton_em_moments(r, act, x, w, shift) -> (s1, s2, mass)``: ``sum_J r act U``,
  ``sum_J r act U^2`` (``[B, m, a, c]`` each) and ``sum_J r act`` (``[B, m]``) with
  ``U = X W - shift``: capsctl/layers/passes/em_moments.py's :class:`VoteMoments`;
- ``capsctl::triton_em_quad(q, p, x, w, shift) -> Q[B, J, m] = sum_d (q U + p U^2)``: its
  :class:`VoteQuad`.

Layouts of ops.py: ``r[B, J, m]``, ``act[B, J]``, ``x[J, B, a, x]``, ``w[J, x, m, c]``,
``shift``, ``q``, ``p`` ``[B, m, a, c]``. The shift is a constant (no gradient), as there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from capsctl.layers.backend.triton import em
from capsctl.layers.backend.triton.ops import acc_dtype, kernel_meta, on_device
from capsctl.layers.backend.triton.plan import LaunchPlan, launch_plan

__all__ = ["em_meta", "em_plan", "triton_em_moments", "triton_em_quad"]


def em_plan(x: Tensor, w: Tensor, tiling: list[int]) -> LaunchPlan:
    """The launch shapes of kernels.py's passes (plan.py): EM's kernels tile alike."""
    j, bsz, a, xd = x.shape
    return launch_plan(j, bsz, w.shape[2], a, w.shape[3], xd, x.element_size(), *tiling)


def em_meta(x: Tensor, w: Tensor, plan: LaunchPlan, quad: bool, *numels: int) -> dict:
    """The constexprs every EM kernel takes (ops.kernel_meta's, the padded sizes, ``QUAD``)."""
    meta = kernel_meta(x, w.shape[2], x.shape[2], w.shape[3], plan, *numels) | plan.pads()
    return meta | {"QUAD": quad}


def _forward(
    k: Tensor,
    act: Tensor,
    q: Tensor,
    p: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    quad: bool,
    tiling: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    dt = acc_dtype(x)[0]
    k, act, q, p, x, w, shift = (t.contiguous() for t in (k, act, q, p, x, w, shift))
    plan = em_plan(x, w, tiling)
    if quad:
        o1 = x.new_empty(bsz, j, m, dtype=dt)  # [B, J, m], stored
        o2 = mass = o1  # not written
    else:
        o1 = x.new_empty(plan.spans, bsz, m, a, c, dtype=dt)  # [spans, B, m, a, c]
        o2 = torch.empty_like(o1)
        mass = x.new_empty(plan.spans, bsz, m, dtype=dt)  # [spans, B, m]
    meta = em_meta(x, w, plan, quad, o1.numel(), k.numel())
    with on_device(x):
        em.em_forward[plan.grid(bsz)](
            x, w, shift, k, act, q, p, o1, o2, mass, j, bsz, plan.span, BB=plan.block, **meta,
            num_warps=plan.warps, num_stages=plan.stages,
        )  # fmt: skip
    if not quad:  # the spans' sums
        o1, o2, mass = (t[0] if plan.spans == 1 else t.sum(0) for t in (o1, o2, mass))
    return o1.to(x.dtype), o2.to(x.dtype), mass.to(x.dtype)


def _backward(
    k: Tensor,
    act: Tensor,
    g1: Tensor,
    g2: Tensor,
    gm: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    quad: bool,
    needs: list[bool],
    tiling: list[int],
) -> tuple:
    """Moments: ``(dr, dact, dx, dw)``; quadratic form: ``(dq, dp, dx, dw)``; an unneeded
    gradient is an empty tensor (``needs``: the coefficients', ``x``'s, ``w``'s)."""
    j, bsz, a, xd = x.shape
    m, c = w.shape[2], w.shape[3]
    dt = acc_dtype(x)[0]
    k, act, g1, g2, gm, x, w, shift = (t.contiguous() for t in (k, act, g1, g2, gm, x, w, shift))
    plan = em_plan(x, w, tiling)
    empty = x.new_zeros(1, dtype=dt)
    if not needs[0]:
        gk = gact = empty
    elif quad:
        gk = x.new_empty(plan.spans, bsz, m, a, c, dtype=dt)  # dq [spans, B, m, a, c]
        gact = torch.empty_like(gk)  # dp [spans, B, m, a, c]
    else:
        gk = x.new_empty(bsz, j, m, dtype=dt)  # dr [B, J, m], stored
        gact = x.new_empty(bsz, j, dtype=dt)  # dact [B, J], stored
    gx = x.new_empty(j, bsz, a, xd, dtype=dt) if needs[1] else empty  # [J, B, a, x]
    gw = x.new_empty(plan.w_spans, j, xd, m, c, dtype=dt) if needs[2] else empty
    meta = em_meta(x, w, plan, quad, gk.numel(), gw.numel(), k.numel())
    # dV = k (g1 + 2 U g2): k = r (times act) and g = (gS1, gS2) for the moments, k = gQ and
    # g = (q, p) for the quadratic form
    dv_args = (x, w, shift, k, act, g1, g2)
    with on_device(x):
        if needs[0]:
            em.em_backward[plan.grid(bsz)](
                x, w, shift, k, act, g1, g2, gm, gk, gact, j, bsz, plan.span, BB=plan.block,
                **meta, num_warps=plan.warps, num_stages=plan.stages,
            )  # fmt: skip
        if needs[1]:
            em.em_input_grad[plan.grid(bsz)](
                *dv_args, gx, j, bsz, plan.span, BB=plan.block, MB=plan.xv_parents, **meta,
                num_warps=plan.x_warps, num_stages=plan.stages,
            )  # fmt: skip
        if needs[2]:
            wmeta = {key: v for key, v in meta.items() if key != "MP"}
            em.em_weight_grad[plan.w_grid(j)](
                *dv_args, gw, j, bsz, plan.w_span, BB=plan.w_block, MB=plan.w_parents,
                **wmeta, num_warps=plan.w_warps, num_stages=plan.stages,
            )  # fmt: skip
    if needs[0] and quad:
        gk, gact = (t[0] if plan.spans == 1 else t.sum(0) for t in (gk, gact))
    if needs[2]:
        gw = gw[0] if plan.w_spans == 1 else gw.sum(0)  # [J, x, m, c]
    want = (needs[0], needs[0], needs[1], needs[2])
    return tuple(
        g.to(x.dtype) if n else x.new_empty(0)
        for g, n in zip((gk, gact, gx, gw), want, strict=True)
    )


@torch.library.custom_op("capsctl::triton_em_moments", mutates_args=())
def _moments_op(
    r: Tensor, act: Tensor, x: Tensor, w: Tensor, shift: Tensor, tiling: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    return _forward(r, act, shift, shift, x, w, shift, False, tiling)


@_moments_op.register_fake
def _(r, act, x, w, shift, tiling):  # type: ignore[no-untyped-def]
    return torch.empty_like(shift), torch.empty_like(shift), shift.new_empty(shift.shape[:2])


@torch.library.custom_op("capsctl::triton_em_moments_backward", mutates_args=())
def _moments_bwd_op(
    r: Tensor,
    act: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    g1: Tensor,
    g2: Tensor,
    gm: Tensor,
    needs: list[bool],
    tiling: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(r, act, g1, g2, gm, x, w, shift, False, needs, tiling)


@_moments_bwd_op.register_fake
def _(r, act, x, w, shift, g1, g2, gm, needs, tiling):  # type: ignore[no-untyped-def]
    want = (needs[0], needs[0], needs[1], needs[2])
    full = (r, act, x, w)
    return tuple(
        torch.empty_like(t) if n else x.new_empty(0) for t, n in zip(full, want, strict=True)
    )


def _moments_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs[:5])
    ctx.tiling = inputs[5]


def _moments_grad(ctx, g1, g2, gm):  # type: ignore[no-untyped-def]
    r, act, x, w, shift = ctx.saved_tensors
    n = ctx.needs_input_grad
    g1 = torch.zeros_like(shift) if g1 is None else g1
    g2 = torch.zeros_like(shift) if g2 is None else g2
    gm = shift.new_zeros(shift.shape[:2]) if gm is None else gm
    needs = [n[0] or n[1], n[2], n[3]]
    gr, gact, gx, gw = _moments_bwd_op(r, act, x, w, shift, g1, g2, gm, needs, ctx.tiling)
    keep = (n[0], n[1], n[2], n[3])
    return (*(g if k else None for g, k in zip((gr, gact, gx, gw), keep, strict=True)), None, None)


_moments_op.register_autograd(_moments_grad, setup_context=_moments_setup)


@torch.library.custom_op("capsctl::triton_em_quad", mutates_args=())
def _quad_op(
    q: Tensor, p: Tensor, x: Tensor, w: Tensor, shift: Tensor, tiling: list[int]
) -> Tensor:
    return _forward(q, q, q, p, x, w, shift, True, tiling)[0]


@_quad_op.register_fake
def _(q, p, x, w, shift, tiling):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[1], x.shape[0], w.shape[2])


@torch.library.custom_op("capsctl::triton_em_quad_backward", mutates_args=())
def _quad_bwd_op(
    q: Tensor,
    p: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    gq: Tensor,
    needs: list[bool],
    tiling: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(gq, gq, q, p, gq, x, w, shift, True, needs, tiling)


@_quad_bwd_op.register_fake
def _(q, p, x, w, shift, gq, needs, tiling):  # type: ignore[no-untyped-def]
    want = (needs[0], needs[0], needs[1], needs[2])
    full = (q, p, x, w)
    return tuple(
        torch.empty_like(t) if n else x.new_empty(0) for t, n in zip(full, want, strict=True)
    )


def _quad_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs[:5])
    ctx.tiling = inputs[5]


def _quad_grad(ctx, gq):  # type: ignore[no-untyped-def]
    q, p, x, w, shift = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0] or n[1], n[2], n[3]]
    dq, dp, gx, gw = _quad_bwd_op(q, p, x, w, shift, gq, needs, ctx.tiling)
    keep = (n[0], n[1], n[2], n[3])
    return (*(g if k else None for g, k in zip((dq, dp, gx, gw), keep, strict=True)), None, None)


_quad_op.register_autograd(_quad_grad, setup_context=_quad_setup)


def triton_em_moments(
    r: Tensor, act: Tensor, x: Tensor, w: Tensor, shift: Tensor, block_j: int = 0, sites: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """``(S1, S2[B, m, a, c], mass[B, m])`` of assignments ``r[B, J, m]``, activations
    ``act[B, J]``, poses ``x[J, B, a, x]``, weights ``w[J, x, m, c]`` about ``shift``."""
    return _moments_op(r, act, x, w, shift, [block_j, sites])


def triton_em_quad(
    q: Tensor, p: Tensor, x: Tensor, w: Tensor, shift: Tensor, block_j: int = 0, sites: int = 0
) -> Tensor:
    """``Q[B, J, m] = sum_{a,c} (q U + p U^2)``, ``U = X W - shift`` (``q, p[B, m, a, c]``)."""
    return _quad_op(q, p, x, w, shift, [block_j, sites])
