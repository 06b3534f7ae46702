"""The Triton passes as ``torch.library`` custom ops (namespace ``capsctl``).

Each op has a fake (meta) implementation and its backward registered with
``register_autograd``, so ``torch.compile`` keeps the fused pass as one node instead of
tracing into it. The ops take CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter;
the tests) and CUDA tensors on a GPU.

- ``capsctl::triton_routed(x, w, p, scale) -> (s, r)``: the IDPA routed pass of
  capsctl/layers/passes/routed.py (``r`` not differentiable);
- ``capsctl::triton_weighted(x, w, r) -> s``: the weighted pass of
  capsctl/layers/passes/weighted.py, differentiable in ``x``, ``w`` and ``r``;

Shapes: ``x[J, B, a, x]``, ``w[J, x, m, c]``, ``p[B, m, a, c]``, ``r[J, B, m]``,
``s[B, m, a, c]``. Outputs have the dtype of ``x`` (coefficients: of the sums); sums run in
float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from capsctl.layers.backend.triton import interpreted, kernels
from capsctl.layers.backend.triton.plan import LaunchPlan, launch_plan

__all__ = [
    "acc_dtype",
    "block_sizes",
    "kernel_meta",
    "launch_shape",
    "on_device",
    "triton_routed",
    "triton_weighted",
]

# elements of a program's vote block [BJ, BM, BA, BC] the default child tile aims at
_BLOCK_ELEMENTS = 4096
# programs the default span of sites aims at (a few per streaming multiprocessor)
_PROGRAMS = 4096


def acc_dtype(t: Tensor) -> tuple[torch.dtype, object]:
    """The accumulation dtype of ``t``, in torch and in Triton."""
    if t.dtype == torch.float64:
        return torch.float64, kernels.tl.float64
    return torch.float32, kernels.tl.float32


def launch_shape(
    j: int, bsz: int, m: int, a: int, c: int, block_j: int = 0, sites: int = 0
) -> tuple[int, int, tuple[int, int]]:
    """``(BJ, SB, grid)``: children per tile, sites per program and the grid
    ``(child tiles, site spans)``; ``block_j``/``sites`` (> 0) fix the first two."""
    per_child = triton.next_power_of_2(m) * triton.next_power_of_2(a) * triton.next_power_of_2(c)
    bj = block_j or max(1, min(triton.next_power_of_2(j), _BLOCK_ELEMENTS // per_child))
    tiles = triton.cdiv(j, bj)
    sb = sites or max(1, triton.cdiv(bsz * tiles, _PROGRAMS))
    return bj, sb, (tiles, triton.cdiv(bsz, sb))


def block_sizes(m: int, a: int, c: int, xd: int) -> dict[str, int]:
    np2 = triton.next_power_of_2
    return {"BM": np2(m), "BA": np2(a), "BC": np2(c)} | ({"BX": np2(xd)} if xd else {})


def kernel_meta(x: Tensor, m: int, a: int, c: int, plan: LaunchPlan, *numels: int) -> dict:
    """The constexprs the routed and weighted kernels share: sizes, types (``ACC`` sums, ``DT``
    of the vote product, ``DOT`` the precision of float32 products), int64 offsets where a
    tensor of ``numels`` (or ``x``) has ``2**31`` elements or more, and the padded sizes."""
    acc = acc_dtype(x)[1]
    dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, acc)
    if interpreted():
        # Triton's interpreter multiplies a bf16 tl.dot's raw bits (it keeps bf16 as uint16);
        # 16-bit values widened to float32 are exact and so are their products, so the
        # float32 product is the tensor cores' (exact products, float32 sums)
        dt = acc
    return {
        "M": m, "A": a, "C": c, "XD": x.shape[3], "ACC": acc, "DT": dt,
        "DOT": "ieee" if x.dtype == torch.float64 else "tf32x3",
        "I64": max(x.numel(), *numels) >= 2**31,
    }  # fmt: skip


def _sum_launch(
    x: Tensor, w: Tensor, p: Tensor, r: Tensor, q: Tensor, s: Tensor, scale: float,
    routed: bool, coef: int, plan: LaunchPlan, meta: dict,
) -> None:  # fmt: skip
    """:func:`kernels.pass_forward` into ``s[spans, B, m, a, c]``: routed (``r`` written) or
    weighted by the coefficients ``coef`` says (kernels.py: ``r``; the softmax of the agreement
    in ``r``, stored to ``q``; ``dA`` of ``R`` in ``r`` and ``dR`` in ``p``, stored to ``q``)."""
    j, bsz = x.shape[:2]
    with on_device(x):
        kernels.pass_forward[plan.parent_grid(bsz, w.shape[2])](
            x, w, p, r, q, s, j, bsz, plan.span, scale, ROUTED=routed, COEF=coef,
            BB=plan.block, **(meta | {"MP": plan.parents, "MF": plan.mp}),
            num_warps=plan.warps, num_stages=plan.stages,
        )  # fmt: skip


def _agreement_launch(
    x: Tensor, w: Tensor, r: Tensor, g: Tensor, gp: Tensor, da: Tensor, scale: float,
    routed: bool, need_p: bool, need_a: bool, plan: LaunchPlan, meta: dict,
) -> None:  # fmt: skip
    """:func:`kernels.pass_backward`: routed ``dP`` and ``dA``, or weighted
    ``gp[J, B, m] = scale sum_{a,c} V g`` (``dR``; with ``g = P``, the agreement)."""
    j, bsz = x.shape[:2]
    with on_device(x):
        kernels.pass_backward[plan.parent_grid(bsz, w.shape[2])](
            x, w, r, g, gp, da, j, bsz, plan.span, scale, ROUTED=routed, NEED_P=need_p,
            NEED_A=need_a, BB=plan.block, **(meta | {"MP": plan.parents}),
            num_warps=plan.warps, num_stages=plan.stages,
        )  # fmt: skip


def _forward(
    x: Tensor, w: Tensor, p: Tensor | None, r: Tensor | None, scale: float, tiling: Sequence[int]
) -> tuple[Tensor, Tensor]:
    """``(s[B, m, a, c], r[J, B, m])``: routed when ``p`` is given, else weighted by ``r``."""
    j, bsz, a, xd = x.shape
    m, c = w.shape[2], w.shape[3]
    dt = acc_dtype(x)[0]
    x, w = x.contiguous(), w.contiguous()
    plan = launch_plan(j, bsz, m, a, c, xd, x.element_size(), *tiling)
    s = x.new_empty(plan.spans, bsz, m, a, c, dtype=dt)  # [spans, B, m, a, c], one sum a span
    routed = p is not None
    if routed:
        p = p.contiguous()
        r = x.new_empty(j, bsz, m, dtype=dt)  # [J, B, m]
    else:
        r = r.contiguous()
        p = s  # not read
    meta = kernel_meta(x, m, a, c, plan, s.numel(), r.numel()) | plan.pads()
    if routed and plan.wide:  # A = scale sum_{a,c} V P, then R = softmax_m(A) and S
        agreement = x.new_empty(j, bsz, m, dtype=dt)  # [J, B, m]
        _agreement_launch(x, w, r, p, agreement, r, scale, False, True, False, plan, meta)
        _sum_launch(x, w, s, agreement, r, s, scale, False, 1, plan, meta)
    else:
        _sum_launch(x, w, p, r, s, s, scale, routed, 0, plan, meta)
    s = s[0] if plan.spans == 1 else s.sum(0)  # [B, m, a, c]
    return s.to(x.dtype), r


def _backward(
    x: Tensor,
    w: Tensor,
    p: Tensor | None,
    r: Tensor,
    gs: Tensor,
    scale: float,
    needs: Sequence[bool],
    tiling: Sequence[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """``(gx[J, B, a, x], gw[J, x, m, c], gp)`` with ``gp`` the gradient of ``p[B, m, a, c]``
    (routed) or of ``r[J, B, m]`` (weighted), each in its input's dtype; an unneeded gradient
    is an empty tensor."""
    j, bsz, a, xd = x.shape
    m, c = w.shape[2], w.shape[3]
    dt = acc_dtype(x)[0]
    x, w, r, gs = x.contiguous(), w.contiguous(), r.contiguous(), gs.contiguous()
    routed = p is not None
    need_x, need_w, need_p = (bool(n) for n in needs)
    need_a = routed and (need_w or need_x)  # dA[J, B, m] for dV = R G + dA (scale P)
    plan = launch_plan(j, bsz, m, a, c, xd, x.element_size(), *tiling)
    empty = x.new_zeros(1, dtype=dt)
    gx = x.new_empty(j, bsz, a, xd, dtype=dt) if need_x else empty  # [J, B, a, x], stored
    if not need_p:
        gp = empty
    elif routed:
        gp = x.new_empty(plan.spans, bsz, m, a, c, dtype=dt)  # [spans, B, m, a, c]
    else:
        gp = x.new_empty(j, bsz, m, dtype=dt)  # dR [J, B, m], stored
    da = x.new_empty(j, bsz, m, dtype=dt) if need_a else empty  # [J, B, m], stored
    gw = x.new_empty(plan.w_spans, j, xd, m, c, dtype=dt) if need_w else empty
    pp = p.contiguous() if routed else gs  # P, not read by the weighted pass
    meta = kernel_meta(x, m, a, c, plan, gp.numel(), gw.numel(), r.numel()) | plan.pads()
    if routed and plan.wide and (need_p or need_a):  # dR, then dA and dP = scale sum_J dA V
        dr = x.new_empty(j, bsz, m, dtype=dt)  # [J, B, m]
        _agreement_launch(x, w, r, gs, dr, da, 1.0, False, True, False, plan, meta)
        if need_p:
            da = x.new_empty(j, bsz, m, dtype=dt) if not need_a else da  # [J, B, m]
            _sum_launch(x, w, dr, r, da, gp, scale, False, 2, plan, meta)
            gp = gp[0] if plan.spans == 1 else gp.sum(0)  # [B, m, a, c]
        else:  # dA alone (P takes no gradient)
            da = r * (dr - (r * dr).sum(-1, keepdim=True))  # [J, B, m], before the scale
    elif need_p or need_a:  # first dA (routed) or dR (weighted): they need the votes
        _agreement_launch(x, w, r, gs, gp, da, scale, routed, need_p, need_a, plan, meta)
        if need_p and routed:
            gp = gp[0] if plan.spans == 1 else gp.sum(0)  # [B, m, a, c]
    with on_device(x):
        if need_x:
            xmeta = {k: v for k, v in meta.items() if k != "MP"}
            kernels.pass_input_grad[plan.grid(bsz)](
                w, pp, r, da, gs, gx, j, bsz, plan.span, scale, ROUTED=routed,
                BB=plan.block, MP=plan.mp, MB=plan.x_parents, **xmeta,
                num_warps=plan.x_warps, num_stages=plan.stages,
            )  # fmt: skip
        if need_w:
            meta = {k: v for k, v in meta.items() if k not in ("DT", "MP")}
            kernels.pass_weight_grad[plan.w_grid(j)](
                x, pp, r, da, gs, gw, j, bsz, plan.w_span, scale, ROUTED=routed,
                BB=plan.w_block, MB=plan.w_parents, **meta,
                num_warps=plan.w_warps, num_stages=plan.stages,
            )  # fmt: skip
    if need_w:
        gw = gw[0] if plan.w_spans == 1 else gw.sum(0)  # [J, x, m, c]
    wanted = (x, w, p if routed else r)
    return tuple(
        g.to(t.dtype) if n else x.new_empty(0)
        for g, t, n in zip((gx, gw, gp), wanted, needs, strict=True)
    )


def on_device(t: Tensor) -> contextlib.AbstractContextManager:
    """The CUDA device of ``t`` made current for the launch (nothing for a CPU tensor, which
    only Triton's interpreter runs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@torch.library.custom_op("capsctl::triton_routed", mutates_args=())
def _routed_op(
    x: Tensor, w: Tensor, p: Tensor, scale: float, tiling: list[int]
) -> tuple[Tensor, Tensor]:
    return _forward(x, w, p, None, scale, tiling)


@_routed_op.register_fake
def _(x: Tensor, w: Tensor, p: Tensor, scale: float, tiling: list[int]) -> tuple[Tensor, Tensor]:
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    return x.new_empty(bsz, m, a, c), x.new_empty(j, bsz, m, dtype=acc_dtype(x)[0])


@torch.library.custom_op("capsctl::triton_routed_backward", mutates_args=())
def _routed_bwd_op(
    x: Tensor, w: Tensor, p: Tensor, r: Tensor, gs: Tensor, scale: float,
    needs: list[bool], tiling: list[int],
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _backward(x, w, p, r, gs, scale, needs, tiling)


@_routed_bwd_op.register_fake
def _(x, w, p, r, gs, scale, needs, tiling):  # type: ignore[no-untyped-def]
    full = (x, w, p)
    return tuple(
        torch.empty_like(t) if n else x.new_empty(0) for t, n in zip(full, needs, strict=True)
    )


def _routed_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, p, scale, tiling = inputs
    ctx.save_for_backward(x, w, p, output[1])
    ctx.scale, ctx.tiling = scale, tiling
    ctx.mark_non_differentiable(output[1])
    # no zero gradient of R (as large as R: 231 MB a pass on cifar10-dynamic-simple at batch
    # 128) is built for the backward, which never reads it
    ctx.set_materialize_grads(False)


def _routed_grad(ctx, gs: Tensor | None, _gr: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[no-untyped-def]
    if gs is None:  # S reached no loss
        return None, None, None, None, None
    x, w, p, r = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])
    grads = _routed_bwd_op(x, w, p, r, gs, ctx.scale, needs, ctx.tiling)
    return (*(g if n else None for g, n in zip(grads, needs, strict=True)), None, None)


_routed_op.register_autograd(_routed_grad, setup_context=_routed_setup)


@torch.library.custom_op("capsctl::triton_weighted", mutates_args=())
def _weighted_op(x: Tensor, w: Tensor, r: Tensor, tiling: list[int]) -> Tensor:
    return _forward(x, w, None, r, 1.0, tiling)[0]


@_weighted_op.register_fake
def _(x: Tensor, w: Tensor, r: Tensor, tiling: list[int]) -> Tensor:
    return x.new_empty(x.shape[1], w.shape[2], x.shape[2], w.shape[3])


@torch.library.custom_op("capsctl::triton_weighted_backward", mutates_args=())
def _weighted_bwd_op(
    x: Tensor, w: Tensor, r: Tensor, gs: Tensor, needs: list[bool], tiling: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(x, w, None, r, gs, 1.0, needs, tiling)


@_weighted_bwd_op.register_fake
def _(x, w, r, gs, needs, tiling):  # type: ignore[no-untyped-def]
    return tuple(
        torch.empty_like(t) if n else x.new_empty(0) for t, n in zip((x, w, r), needs, strict=True)
    )


def _weighted_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, w, r, tiling = inputs
    ctx.save_for_backward(x, w, r)
    ctx.tiling = tiling


def _weighted_grad(ctx, gs: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[no-untyped-def]
    x, w, r = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:3])
    grads = _weighted_bwd_op(x, w, r, gs, needs, ctx.tiling)
    return (*(g if n else None for g, n in zip(grads, needs, strict=True)), None)


_weighted_op.register_autograd(_weighted_grad, setup_context=_weighted_setup)


def triton_routed(
    x: Tensor, w: Tensor, p: Tensor, scale: float, block_j: int = 0, sites: int = 0
) -> tuple[Tensor, Tensor]:
    """The routed pass ``(S[B, m, a, c], R[J, B, m])`` of ``x[J, B, a, x]``, ``w[J, x, m, c]``
    and ``p[B, m, a, c]`` as the op ``capsctl::triton_routed``; ``block_j``/``sites`` (> 0):
    children per tile and sites per program (:func:`launch_shape`)."""
    return _routed_op(x, w, p, float(scale), [block_j, sites])


def triton_weighted(x: Tensor, w: Tensor, r: Tensor, block_j: int = 0, sites: int = 0) -> Tensor:
    """The weighted pass ``S[B, m, a, c] = sum_J R V`` of ``x[J, B, a, x]``, ``w[J, x, m, c]``
    and ``r[J, B, m]`` as the op ``capsctl::triton_weighted``."""
    return _weighted_op(x, w, r, [block_j, sites])
