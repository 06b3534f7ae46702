"""EM routing's M-step rest (mstep.py) as the ``torch.library`` custom op
``capsctl::triton_m_step``: capsctl/layers/routers/em/procedure.py's ``_m_step`` without cost
standardization, in one kernel forward and one backward (the torch code is some twenty
operators over parent-sized tensors each way, recomputed in the backward pass).

``triton_m_step(s, mass, shift, beta_u, beta_a, lam, eps, var_eps) -> (mu, act, qp, c)`` with
``s[2, B, d, m]``, ``mass[B, m, 1]``, ``shift[B, d, m]`` (a constant: no gradient),
``beta_u[m]``, ``beta_a[m]``; ``mu[B, m, d]`` (a transposed view of a ``[B, d, m]`` tensor),
``act[B, m]``, ``qp[2, B, d, m]`` and ``c[B, m, 1]``, as ``_m_step`` returns them.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from capsctl.layers.backend.triton import mstep
from capsctl.layers.backend.triton.ops import acc_dtype, on_device

__all__ = ["triton_m_step"]

# parents' pose entries a program holds ([BB, DP, MP] tiles of several tensors at once): 8 a
# thread of 4 warps (all 128 parents of 6x6 poses, 8,192 entries, held 255 registers and spilled)
_ELEMENTS = 1024
_WARPS = 4


def _meta(s: Tensor) -> tuple[dict, tuple[int, int]]:
    """The kernels' constexprs and grid ``(site blocks, parent blocks)``: ``MP`` parents a
    program, as many as :data:`_ELEMENTS` allows, and ``BB`` sites."""
    _, bsz, d, m = s.shape
    dp = triton.next_power_of_2(d)
    mp = min(triton.next_power_of_2(m), max(1, _ELEMENTS // dp))
    bb = max(1, _ELEMENTS // (dp * mp))
    meta = {"M": m, "D": d, "ACC": acc_dtype(s)[1], "I64": s.numel() >= 2**31}
    return meta | {"BB": bb, "DP": dp, "MP": mp}, (triton.cdiv(bsz, bb), triton.cdiv(m, mp))


@torch.library.custom_op("capsctl::triton_m_step", mutates_args=())
def _m_step_op(
    s: Tensor, mass: Tensor, shift: Tensor, beta_u: Tensor, beta_a: Tensor, consts: list[float]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    s, mass, shift, beta_u, beta_a = (t.contiguous() for t in (s, mass, shift, beta_u, beta_a))
    _, bsz, d, m = s.shape
    mu = torch.empty_like(shift)  # [B, d, m]
    qp = torch.empty_like(s)  # [2, B, d, m]
    act, c = s.new_empty(bsz, m), s.new_empty(bsz, m)
    if s.numel():
        meta, grid = _meta(s)
        with on_device(s):
            mstep.m_step_forward[grid](
                s, mass, shift, beta_u, beta_a, mu, act, qp, c, bsz, *consts, **meta,
                num_warps=_WARPS,
            )  # fmt: skip
    return mu, act, qp, c


@_m_step_op.register_fake
def _(s, mass, shift, beta_u, beta_a, consts):  # type: ignore[no-untyped-def]
    bsz, m = s.shape[1], s.shape[3]
    return torch.empty_like(shift), s.new_empty(bsz, m), torch.empty_like(s), s.new_empty(bsz, m)


@torch.library.custom_op("capsctl::triton_m_step_backward", mutates_args=())
def _m_step_bwd_op(
    s: Tensor, mass: Tensor, shift: Tensor, beta_u: Tensor, beta_a: Tensor, consts: list[float],
    g_mu: Tensor | None, g_act: Tensor | None, g_qp: Tensor | None, g_c: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``s[2, B, d, m]``, ``mass[B, m]`` and of ``(beta_u, beta_a)`` as one
    ``[2, m]``; an output whose gradient is None has none (zero, and nothing is read)."""
    s, mass, shift, beta_u, beta_a = (t.contiguous() for t in (s, mass, shift, beta_u, beta_a))
    given = [None if g is None else g.contiguous() for g in (g_mu, g_act, g_qp, g_c)]
    _, bsz, d, m = s.shape
    gs = torch.empty_like(s)  # [2, B, d, m]
    gmass = s.new_empty(bsz, m)  # [B, m]
    meta, grid = _meta(s)
    if not s.numel():
        return gs, gmass, s.new_zeros(2, m)
    gb = s.new_empty(grid[0], 2, m)  # [site blocks, 2, m]: each program writes its sums
    present = {
        k: g is not None for k, g in zip(("G_MU", "G_ACT", "G_QP", "G_C"), given, strict=True)
    }
    with on_device(s):
        mstep.m_step_backward[grid](
            s, mass, shift, beta_u, beta_a, *(s if g is None else g for g in given), gs, gmass,
            gb, bsz, *consts, **meta, **present, num_warps=_WARPS,
        )  # fmt: skip
    return gs, gmass, gb.sum(0)  # ..., [2, m]


@_m_step_bwd_op.register_fake
def _(s, mass, shift, beta_u, beta_a, consts, g_mu, g_act, g_qp, g_c):  # type: ignore[no-untyped-def]
    bsz, m = s.shape[1], s.shape[3]
    return torch.empty_like(s), s.new_empty(bsz, m), s.new_empty(2, m)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    s, mass, shift, beta_u, beta_a, consts = inputs
    ctx.save_for_backward(s, mass, shift, beta_u, beta_a)
    ctx.consts = consts
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: nothing read


def _grad(ctx, g_mu, g_act, g_qp, g_c):  # type: ignore[no-untyped-def]
    s, mass, shift, beta_u, beta_a = ctx.saved_tensors
    gs, gmass, gb = _m_step_bwd_op(
        s, mass, shift, beta_u, beta_a, ctx.consts, g_mu, g_act, g_qp, g_c
    )
    gbu, gba = gb.unbind(0)  # [m] each
    return gs, gmass.view(mass.shape), None, gbu, gba, None  # [2, B, d, m], [B, m], ...


_m_step_op.register_autograd(_grad, setup_context=_setup)


def triton_m_step(
    s: Tensor,
    mass: Tensor,
    shift: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    lam: float,
    eps: float,
    var_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``_m_step``'s ``(mu[B, m, d], act[B, m], qp[2, B, d, m], c[B, m, 1])`` of the moments
    ``s[2, B, d, m]``, ``mass[B, m, 1]``, the shift ``shift[B, d, m]`` and ``beta_u[m]``,
    ``beta_a[m]`` at inverse temperature ``lam``, with ``eps`` added to the mass and
    ``var_eps`` to each variance, as the op ``capsctl::triton_m_step``."""
    consts = [float(lam), float(eps), float(var_eps)]
    mass = mass.reshape(mass.shape[0], -1)  # [B, m, 1] -> [B, m]
    mu, act, qp, c = _m_step_op(s, mass, shift, beta_u, beta_a, consts)
    return mu.transpose(1, 2), act, qp, c.unsqueeze(-1)
