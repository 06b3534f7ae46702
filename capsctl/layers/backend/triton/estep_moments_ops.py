"""EM routing's E-step fused into the next M-step's moments (em_estep.py) as ``torch.library``
custom ops: the pieces of capsctl/layers/routers/em/windows.py's
:class:`~capsctl.layers.routers.em.windows.TritonEStepMoments`, which joins them with a conv
layer's window sums. The assignments ``R[B, J, m]`` are never stored: every kernel builds them
again from the votes, the E-step's operands and the child's normalizer ``lse[B, J]``.

- ``capsctl::triton_em_estep_stats(q, p, c, x, w, shift) -> (zmax, esum)``, ``[B, J]`` each;
- ``capsctl::triton_em_estep_moments(q, p, c, lse, act, x, w, shift) -> (S, mass)``, ``S[2,
  B, m, a, c]`` holding ``S1, S2``;
- ``capsctl::triton_em_estep_rowdot(..., gS1, gS2, gmass) -> (T, dact)``, ``[B, J]`` each;
- ``capsctl::triton_em_estep_grads(..., gS1, gS2, gmass, Tc, needs) -> (dq, dp, dc, dx, dw)``.

Layouts of em_ops.py: ``q, p, shift, S1, S2[B, m, a, c]``, ``c, mass[B, m]``, ``lse, act[B,
J]``, ``x[J, B, a, x]``, ``w[J, x, m, c]``. Sums in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from capsctl.layers.backend.triton import em_estep
from capsctl.layers.backend.triton.em_ops import em_meta, em_plan
from capsctl.layers.backend.triton.ops import acc_dtype, on_device

__all__ = [
    "triton_em_estep_grads",
    "triton_em_estep_moments",
    "triton_em_estep_rowdot",
    "triton_em_estep_stats",
]


# warps the E-step's kernels take beyond their plan's: the backward's operand-gradient kernel
# keeps five parent-sized tiles live (the shift, q, p, gS1, gS2) besides its two sums and the
# votes, the moments their two sums, the votes, the shift and the quadratic form's operands,
# the backward's first kernel the shift, q, p, gS1 and gS2: about twice the routed pass's, so
# that twice the warps keep a thread within the register budget (sm_90a: 223 registers a
# thread with the plan's warps, 128 with twice as many; at 32 parents of 6x6 poses the moments
# 177 and 108, the first backward kernel 176 and 110)
_WIDER = 2
_MAX_WARPS = 16


def _wider(warps: int) -> int:
    return min(_WIDER * warps, _MAX_WARPS)


def _ready(*ts: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in ts)


def _span_sum(t: Tensor) -> Tensor:
    """The per-span partial sums ``[spans, ...]`` added up."""
    return t[0] if t.shape[0] == 1 else t.sum(0)


@torch.library.custom_op("capsctl::triton_em_estep_stats", mutates_args=())
def triton_em_estep_stats(
    q: Tensor, p: Tensor, c: Tensor, x: Tensor, w: Tensor, shift: Tensor, tiling: list[int]
) -> tuple[Tensor, Tensor]:
    """``zmax[B, J] = max_m z`` and ``esum[B, J] = sum_m exp(z - zmax)`` of ``z = c - Q / 2``."""
    q, p, c, x, w, shift = _ready(q, p, c, x, w, shift)
    j, bsz = x.shape[:2]
    dt = acc_dtype(x)[0]
    zmax, esum = (x.new_empty(bsz, j, dtype=dt) for _ in range(2))  # [B, J] each
    plan = em_plan(x, w, tiling)
    meta = {k: v for k, v in em_meta(x, w, plan, False, zmax.numel()).items() if k != "QUAD"}
    with on_device(x):
        em_estep.em_estep_stats[plan.grid(bsz)](
            x, w, shift, q, p, c, zmax, esum, j, bsz, plan.span, BB=plan.block, **meta,
            num_warps=plan.warps, num_stages=plan.stages,
        )  # fmt: skip
    return zmax, esum


@triton_em_estep_stats.register_fake
def _(q, p, c, x, w, shift, tiling):  # type: ignore[no-untyped-def]
    return x.new_empty(x.shape[1], x.shape[0]), x.new_empty(x.shape[1], x.shape[0])


@torch.library.custom_op("capsctl::triton_em_estep_moments", mutates_args=())
def triton_em_estep_moments(
    q: Tensor,
    p: Tensor,
    c: Tensor,
    lse: Tensor,
    act: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    tiling: list[int],
) -> tuple[Tensor, Tensor]:
    """``S[2, B, m, a, c] = sum_J (k U, k U^2)`` and ``mass[B, m] = sum_J k``, ``k = R act``:
    one tensor for both moments, so that one sum adds the spans' partials up and the M-step's
    layout is one copy away."""
    q, p, c, lse, act, x, w, shift = _ready(q, p, c, lse, act, x, w, shift)
    j, bsz, a, _ = x.shape
    m, cc = w.shape[2], w.shape[3]
    dt = acc_dtype(x)[0]
    plan = em_plan(x, w, tiling)
    o = x.new_empty(2, plan.spans, bsz, m, a, cc, dtype=dt)  # [2, spans, B, m, a, c]
    o1, o2 = o.unbind(0)  # the kernel's [spans, B, m, a, c] each
    mass = x.new_empty(plan.spans, bsz, m, dtype=dt)  # [spans, B, m]
    meta = {k: v for k, v in em_meta(x, w, plan, False, o1.numel()).items() if k != "QUAD"}
    meta["MP"] = plan.e_parents
    with on_device(x):
        em_estep.em_estep_moments[plan.e_grid(bsz, m)](
            x, w, shift, q, p, c, lse, act, o1, o2, mass, j, bsz, plan.span, BB=plan.block,
            **meta, num_warps=_wider(plan.e_warps), num_stages=plan.stages,
        )  # fmt: skip
    s = o[:, 0] if o.shape[1] == 1 else o.sum(1)  # [2, B, m, a, c]
    return s.to(x.dtype), _span_sum(mass).to(x.dtype)


@triton_em_estep_moments.register_fake
def _(q, p, c, lse, act, x, w, shift, tiling):  # type: ignore[no-untyped-def]
    return shift.new_empty(2, *shift.shape), c.new_empty(c.shape)


@torch.library.custom_op("capsctl::triton_em_estep_rowdot", mutates_args=())
def triton_em_estep_rowdot(
    q: Tensor,
    p: Tensor,
    c: Tensor,
    lse: Tensor,
    act: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    g1: Tensor,
    g2: Tensor,
    gm: Tensor,
    tiling: list[int],
) -> tuple[Tensor, Tensor]:
    """``T[B, J] = sum_m R g act`` and ``dact[B, J] = sum_m g R``, ``g = sum_{a,c} (gS1 U +
    gS2 U^2) + gmass``."""
    q, p, c, lse, act, x, w, shift, g1, g2, gm = _ready(q, p, c, lse, act, x, w, shift, g1, g2, gm)
    j, bsz = x.shape[:2]
    dt = acc_dtype(x)[0]
    plan = em_plan(x, w, tiling)
    m = w.shape[2]
    blocks = triton.cdiv(m, plan.e_parents)
    t, dact = (x.new_empty(blocks, bsz, j, dtype=dt) for _ in range(2))  # [blocks, B, J] each
    meta = {k: v for k, v in em_meta(x, w, plan, False, t.numel()).items() if k != "QUAD"}
    meta["MP"] = plan.e_parents
    with on_device(x):
        em_estep.em_estep_rowdot[plan.e_grid(bsz, m)](
            x, w, shift, q, p, c, lse, act, g1, g2, gm, t, dact, j, bsz, plan.span,
            BB=plan.block, **meta, num_warps=_wider(plan.e_warps), num_stages=plan.stages,
        )  # fmt: skip
    return _span_sum(t), _span_sum(dact)  # [B, J] each


@triton_em_estep_rowdot.register_fake
def _(q, p, c, lse, act, x, w, shift, g1, g2, gm, tiling):  # type: ignore[no-untyped-def]
    return torch.empty_like(lse), torch.empty_like(lse)


@torch.library.custom_op("capsctl::triton_em_estep_grads", mutates_args=())
def triton_em_estep_grads(
    q: Tensor,
    p: Tensor,
    c: Tensor,
    lse: Tensor,
    act: Tensor,
    x: Tensor,
    w: Tensor,
    shift: Tensor,
    g1: Tensor,
    g2: Tensor,
    gm: Tensor,
    tc: Tensor,
    needs: list[bool],
    tiling: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dp[B, m, a, c], dc[B, m], dx[J, B, a, x], dw[J, x, m, c])`` given ``Tc[B, J]``
    (``T`` summed over each child's windows); ``needs``: the E-step operands', ``x``'s and
    ``w``'s (an unneeded gradient is an empty tensor)."""
    q, p, c, lse, act, x, w, shift, g1, g2, gm, tc = _ready(
        q, p, c, lse, act, x, w, shift, g1, g2, gm, tc
    )
    j, bsz, a, xd = x.shape
    m, cc = w.shape[2], w.shape[3]
    dt = acc_dtype(x)[0]
    plan = em_plan(x, w, tiling)
    meta = {k: v for k, v in em_meta(x, w, plan, False, x.numel(), w.numel()).items()}
    meta.pop("QUAD")
    args = (x, w, shift, q, p, c, lse, act, g1, g2, gm, tc)
    # an unneeded gradient: an empty tensor of its own (a custom op's outputs may not alias)
    dq, dp, dc, dx, dw = (x.new_empty(0) for _ in range(5))
    with on_device(x):
        if needs[0]:
            dq = x.new_empty(plan.spans, bsz, m, a, cc, dtype=dt)  # [spans, B, m, a, c]
            dp = torch.empty_like(dq)
            dc = x.new_empty(plan.spans, bsz, m, dtype=dt)  # [spans, B, m]
            em_estep.em_estep_parent_grad[plan.e_grid(bsz, m)](
                *args, dq, dp, dc, j, bsz, plan.span, BB=plan.block,
                **(meta | {"MP": plan.e_parents}), num_warps=_wider(plan.e_warps),
                num_stages=plan.stages,
            )  # fmt: skip
            dq, dp, dc = (_span_sum(t).to(x.dtype) for t in (dq, dp, dc))
        if needs[1]:
            dx = x.new_empty(j, bsz, a, xd, dtype=dt)  # [J, B, a, x]
            em_estep.em_estep_input_grad[plan.grid(bsz)](
                *args, dx, j, bsz, plan.span, BB=plan.block, MB=plan.xv_parents, **meta,
                num_warps=plan.x_warps, num_stages=plan.stages,
            )  # fmt: skip
            dx = dx.to(x.dtype)
        if needs[2]:
            dw = x.new_empty(plan.w_spans, j, xd, m, cc, dtype=dt)  # [spans, J, x, m, c]
            wmeta = {key: v for key, v in meta.items() if key != "MP"}
            em_estep.em_estep_weight_grad[plan.w_grid(j)](
                *args, dw, j, bsz, plan.w_span, BB=plan.w_block, MB=plan.w_parents, **wmeta,
                num_warps=plan.w_warps, num_stages=plan.stages,
            )  # fmt: skip
            dw = _span_sum(dw).to(x.dtype)  # [J, x, m, c]
    return dq, dp, dc, dx, dw


@triton_em_estep_grads.register_fake
def _(q, p, c, lse, act, x, w, shift, g1, g2, gm, tc, needs, tiling):  # type: ignore[no-untyped-def]
    def like(t: Tensor, need: bool) -> Tensor:
        return torch.empty_like(t) if need else x.new_empty(0)

    return (
        like(q, needs[0]),
        like(p, needs[0]),
        like(c, needs[0]),
        like(x, needs[1]),
        like(w, needs[2]),
    )
