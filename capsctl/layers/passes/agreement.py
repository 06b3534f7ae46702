"""Routing by agreement over a whole layer in one pass: every iteration of dynamic routing.

Dynamic routing (Sabour, Frosst, Hinton, NeurIPS 2017, arXiv:1710.09829, Procedure 1) routes
each parent site on its own: iteration 1 sums the votes with coefficients ``1/m``, each later
iteration ``t`` takes the coefficients ``R = softmax_m(<V, Q_t>)`` against the sum of the
parent poses so far, ``Q_t = v_1 + ... + v_{t-1}``, and every sum is squashed,
``v_t = squash(S_t)``. Letters as in capsctl/layers/passes/routed.py: child poses
``X[J, B, a, x]``, weights ``W[J, x, m, c]``, votes ``V[J, B, a, m, c]``.

Run iteration by iteration, each routed pass builds the votes once forward and three times
backward (the votes, their products into ``dX`` and ``dW``). Where the compiled loops run,
:func:`agreement_pass` runs all ``T`` iterations as one pass (csrc/agreement.cpp): a block of
sites runs every iteration on its votes (kept in cache where they fit, else built again for
each use, as capsctl/layers/backend/agreement.py plans), and the backward pass walks the
iterations back, summing the votes' gradients over the iterations before the two products.
Everywhere else it returns None, and the caller routes iteration by iteration
(capsctl/layers/routers/dynamic.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from capsctl.layers.backend.agreement import (
    agreement_backward,
    agreement_forward,
    agreement_plan,
)
from capsctl.layers.backend.cost import VoteShape
from capsctl.layers.backend.dispatch import autocast_dtype, choose, peek
from capsctl.layers.passes.flops import add_routing_flops
from capsctl.layers.passes.tiles import prepare, unprepare_weights

__all__ = ["AgreementPass", "agreement_pass"]


def _site_major(t: Tensor) -> Tensor:
    """``[T, B, m, a, c]`` -> contiguous ``[T, B, d, m]`` (the loops' layout)."""
    n, bsz, m, a, c = t.shape
    return t.permute(0, 1, 3, 4, 2).contiguous().view(n, bsz, a * c, m)  # [T, B, d, m]


def _parent_major(t: Tensor, a: int, c: int) -> Tensor:
    """``[T, B, d, m]`` -> contiguous ``[T, B, m, a, c]``."""
    n, bsz, _, m = t.shape
    return t.view(n, bsz, a, c, m).permute(0, 1, 4, 2, 3).contiguous()  # [T, B, m, a, c]


class AgreementPass(torch.autograd.Function):
    """Autograd function of :func:`agreement_pass` (compiled loops only): saves the child
    poses, the weights, every iteration's sums and coefficients; rebuilds the votes backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, w: Tensor, iterations: int, plan: tuple[int, bool]
    ) -> tuple[Tensor, Tensor]:
        a, c = x.shape[2], w.shape[3]
        xc, wc = prepare(x, w)  # [J, B, a, x], [J, x, c*m]
        s, v, r = agreement_forward(xc, wc, c, iterations, plan)
        ctx.save_for_backward(xc, wc, s, r)
        ctx.c, ctx.plan = c, plan
        ctx.mark_non_differentiable(r)
        ctx.set_materialize_grads(False)
        return _parent_major(v, a, c), r  # [T, B, m, a, c], [T-1, J, B, m]

    @staticmethod
    def backward(ctx, gv: Tensor | None, _gr: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if gv is None:
            return None, None, None, None
        x, wc, s, r = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        gq = _site_major(gv)  # [T, B, d, m]
        gx, gwc = agreement_backward(x, wc, s, r, gq, ctx.c, ctx.plan, needs)  # gwc [J, x, c*m]
        return gx, unprepare_weights(gwc, ctx.c), None, None


def agreement_pass(x: Tensor, w: Tensor, iterations: int) -> tuple[Tensor, Tensor] | None:
    """All ``iterations`` of routing by agreement over ``x[J, B, a, x]`` and ``w[J, x, m, c]``
    in one pass where the compiled loops run: the poses ``v[T, B, m, a, c]`` of every iteration
    (squashed) and the coefficients ``R[T-1, J, B, m]`` of iterations 2..T (detached). None
    where they do not (another device, ``use()``, tracing): route iteration by iteration there.
    Blocks of sites keep their votes or build them again as
    capsctl/layers/backend/agreement.py plans. Under autocast the loops run in float32, as every
    compiled pass."""
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    if iterations < 2:
        return None
    votes, low = VoteShape.of(x.shape, w.shape), autocast_dtype(x)
    if peek(x, w, autocast=low, votes=votes).backend != "native":
        return None
    choose(x, w, autocast=low, votes=votes)  # counted as one pass (dispatch.ran)
    plan = agreement_plan(j, a * c, m)
    # every iteration's agreement and weighted sum: J*B*m*d multiply-accumulates each
    add_routing_flops(2 * 2 * (iterations - 1) * j * bsz * m * a * c)
    with torch.autocast(device_type=x.device.type, enabled=False):
        x, w = x.float(), w.float()
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return AgreementPass.apply(x, w, iterations, plan)
        with torch.no_grad():
            xc, wc = prepare(x, w)
            _, v, r = agreement_forward(xc, wc, c, iterations, plan)
            return _parent_major(v, a, c), r
