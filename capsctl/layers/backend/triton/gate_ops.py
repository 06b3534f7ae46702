"""Self-routing's gate (gate.py) as the ``torch.library`` custom op ``capsctl::triton_gate``.

``triton_gate(x, wr, br, act) -> (coef, mass)``: the coefficients ``c = softmax_m(x W^route +
b^route)`` and the mass ``c a`` (``[J, B, m]`` each) of child poses ``x[J, B, D]``, routing
weights ``wr[J, D, m]``, biases ``br[J, m]`` and child activations ``act[B, J]``: what
capsctl/layers/passes/gated.py's :func:`~capsctl.layers.passes.gated.routing_logits` and
:func:`~capsctl.layers.passes.gated.gate` compute in four torch operators (the logits, the
softmax, the mass and a cast), in one kernel that never stores the logits. The mass is
differentiable in all four inputs; the coefficients are not (self-routing returns them
detached). The backward is one kernel for ``d act``, the logits' gradient and ``dx``, and one
batched matrix product for ``d wr`` (a sum over the sites). Sums in float32 (float64 for
float64 inputs); the gate takes float32 under autocast, as the torch code does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
from torch import Tensor

from capsctl.layers.backend.triton import gate
from capsctl.layers.backend.triton.ops import acc_dtype, on_device

__all__ = ["gate_meta", "triton_gate"]

# sites a program owns (a tl.dot's rows); 64 keeps a program's tiles in few registers
_SITES = 64
_WARPS = 4


def gate_meta(x: Tensor, m: int, *numels: int) -> dict:
    """The gate kernels' constexprs: sizes, the sums' type ``ACC`` and the products' input
    precision ``DOT`` (as ops.kernel_meta's), int64 offsets where a tensor has ``2**31``
    elements or more, and the padded sizes (at least 16, a ``tl.dot``'s smallest tile)."""
    d = x.shape[2]
    np2 = triton.next_power_of_2
    return {
        "M": m, "D": d, "ACC": acc_dtype(x)[1],
        "DOT": "ieee" if x.dtype == torch.float64 else "tf32x3",
        "I64": max(x.numel(), *numels) >= 2**31,
        "BB": _SITES, "DP": max(16, np2(d)), "MP": max(16, np2(m)),
    }  # fmt: skip


def _grid(j: int, bsz: int) -> tuple[int, int]:
    return triton.cdiv(bsz, _SITES), j


def _forward(x: Tensor, wr: Tensor, br: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    j, bsz, _ = x.shape
    m = wr.shape[2]
    x, wr, br, act = (t.contiguous() for t in (x, wr, br, act))
    dt = acc_dtype(x)[0]
    coef = x.new_empty(j, bsz, m, dtype=dt)  # [J, B, m]
    mass = torch.empty_like(coef)  # [J, B, m]
    meta = gate_meta(x, m, coef.numel(), act.numel())
    with on_device(x):
        gate.gate_forward[_grid(j, bsz)](
            x, wr, br, act, coef, mass, j, bsz, **meta, num_warps=_WARPS
        )  # fmt: skip
    return coef, mass


def _backward(
    x: Tensor, wr: Tensor, coef: Tensor, act: Tensor, gm: Tensor, needs: Sequence[bool]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(gx[J, B, D], gwr[J, D, m], gbr[J, m], gact[B, J])`` from ``gm = d loss / d mass``;
    an unneeded gradient is an empty tensor."""
    j, bsz, d = x.shape
    m = wr.shape[2]
    need_x, need_wr, need_br, need_act = (bool(n) for n in needs)
    need_l = need_wr or need_br  # dL[J, B, m] for the weights' gradients
    x, wr, coef, act, gm = (t.contiguous() for t in (x, wr, coef, act, gm))
    dt = acc_dtype(x)[0]
    empty = x.new_zeros(1, dtype=dt)
    dl = x.new_empty(j, bsz, m, dtype=dt) if need_l else empty  # [J, B, m]
    gx = x.new_empty(j, bsz, d, dtype=dt) if need_x else empty  # [J, B, D]
    gact = x.new_empty(bsz, j, dtype=dt) if need_act else empty  # [B, J]
    meta = gate_meta(x, m, coef.numel(), act.numel())
    if need_l or need_x or need_act:
        with on_device(x):
            gate.gate_backward[_grid(j, bsz)](
                wr, coef, act, gm, dl, gx, gact, j, bsz, NEED_L=need_l, NEED_X=need_x,
                NEED_A=need_act, **meta, num_warps=_WARPS,
            )  # fmt: skip
    gwr = torch.bmm(x.transpose(1, 2), dl) if need_wr else empty  # [J, D, B] @ [J, B, m]
    gbr = dl.sum(1) if need_br else empty  # [J, m]
    out = (gx, gwr, gbr, gact)
    wanted = (x, wr, wr, act)
    return tuple(  # type: ignore[return-value]
        g.to(t.dtype) if n else x.new_empty(0) for g, t, n in zip(out, wanted, needs, strict=True)
    )


@torch.library.custom_op("capsctl::triton_gate", mutates_args=())
def _gate_op(x: Tensor, wr: Tensor, br: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    return _forward(x, wr, br, act)


@_gate_op.register_fake
def _(x: Tensor, wr: Tensor, br: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    j, bsz, _ = x.shape
    dt = acc_dtype(x)[0]
    return x.new_empty(j, bsz, wr.shape[2], dtype=dt), x.new_empty(j, bsz, wr.shape[2], dtype=dt)


@torch.library.custom_op("capsctl::triton_gate_backward", mutates_args=())
def _gate_bwd_op(
    x: Tensor, wr: Tensor, coef: Tensor, act: Tensor, gm: Tensor, needs: list[bool]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _backward(x, wr, coef, act, gm, needs)


@_gate_bwd_op.register_fake
def _(x, wr, coef, act, gm, needs):  # type: ignore[no-untyped-def]
    j, m = wr.shape[0], wr.shape[2]
    full = (x, wr, wr.new_empty(j, m), act)
    return tuple(
        torch.empty_like(t) if n else x.new_empty(0) for t, n in zip(full, needs, strict=True)
    )


def _gate_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, wr, _br, act = inputs
    ctx.save_for_backward(x, wr, output[0], act)
    ctx.mark_non_differentiable(output[0])
    ctx.set_materialize_grads(False)  # no zero gradient of the coefficients is built


def _gate_grad(ctx, _gc: Tensor | None, gm: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[no-untyped-def]
    if gm is None:  # the mass reached no loss
        return None, None, None, None
    x, wr, coef, act = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    grads = _gate_bwd_op(x, wr, coef, act, gm, needs)
    return tuple(g if n else None for g, n in zip(grads, needs, strict=True))


_gate_op.register_autograd(_gate_grad, setup_context=_gate_setup)


def triton_gate(x: Tensor, wr: Tensor, br: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    """Self-routing's coefficients and mass ``(c, c a)``, ``[J, B, m]`` each, of ``x[J, B, D]``,
    ``wr[J, D, m]``, ``br[J, m]`` and ``act[B, J]`` as the op ``capsctl::triton_gate``."""
    return _gate_op(x, wr, br, act)
