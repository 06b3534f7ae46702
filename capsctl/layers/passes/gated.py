"""The gated pass of self-routing (Hahn, Pyeon, Kim, "Self-Routing Capsule Networks", NeurIPS
2019): each child's coefficients from its own pose, the votes summed with them, the votes never
kept.

Per parent site (letters and the site layout as in capsctl/layers/passes/routed.py), for child
poses ``x[J, B, a, x]`` with activations ``act[B, J]``, pose weights ``w[J, x, m, c]``, routing
weights ``wr[J, a*x, m]`` and biases ``br[J, m]``:

- logits ``(W^route_i u_i)_j + b^route_ij`` (:func:`routing_logits`), the coefficients
  ``c_ij = softmax_j(logits)`` over the ``m`` parent types of the site and the mass
  ``c_ij a_i`` (:func:`gate`);
- the parent pose ``u_j = sum_i c_ij a_i u_hat_{j|i} / sum_i c_ij a_i`` and the parent
  activation ``a_j = sum_i c_ij a_i / sum_i a_i`` (:func:`parent_activations`).

The coefficients depend on the child alone, never on the votes, so the pose's numerator is a
weighted sum of votes with given weights, the mass: :func:`capsctl.layers.passes.weighted.
weighted_pass`, which never keeps the votes (``B*m*J*d`` numbers) and recomputes them chunk by
chunk in the backward pass; the division by ``sum_i c_ij a_i`` follows per parent
(``[B, m]``). Only coefficient-sized tensors (``[J, B, m]``, ``1/d`` of the votes: ``c`` and the
mass) are kept for the backward pass. Where capsctl/layers/backend/dispatch.py says ``native``,
the logits, the coefficients, the mass and the weighted sum are one pass of the compiled loops
(:class:`GatedPass`). :func:`gated_pass` picks one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from capsctl.layers.backend import bindings
from capsctl.layers.backend.cost import VoteShape
from capsctl.layers.backend.dispatch import choose, run_fused
from capsctl.layers.passes.flops import add_routing_flops
from capsctl.layers.passes.tiles import parent_major, prepare, site_major, unprepare_weights
from capsctl.layers.passes.weighted import weighted_pass

__all__ = [
    "SELF_ROUTING_EPS",
    "GatedPass",
    "gate",
    "gated_pass",
    "parent_activations",
    "routing_logits",
]

# Added to both denominators, sum_i a_i and sum_i c_ij a_i: a site whose children all have
# activation 0 (a sigmoid underflows to 0 in float32 below about -88), or a parent whose
# coefficients all underflow to 0, would otherwise give 0 / 0. Far below float32's resolution
# of any mass near 1, so it changes nothing else.
SELF_ROUTING_EPS = 1e-8


def gate(logits: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    """The coefficients ``c = softmax_m(logits)`` and the mass ``c a`` (``[J, B, m]`` each) of
    ``logits[J, B, m]`` and child activations ``act[B, J]``. Plain autograd: it keeps ``c``,
    and the weighted pass keeps the mass."""
    c = torch.softmax(logits, dim=-1)  # [J, B, m]
    return c, c * act.t().unsqueeze(-1)  # [J, B, m]: c_ij a_i


def parent_activations(total: Tensor, act: Tensor) -> Tensor:
    """``sum_i c_ij a_i / sum_i a_i``: ``total[B, m]`` over ``act[B, J]``'s sum -> ``[B, m]``."""
    return total / (act.sum(-1, keepdim=True) + SELF_ROUTING_EPS)


def routing_logits(xj: Tensor, wr: Tensor, br: Tensor) -> Tensor:
    """``W^route_i u_i + b^route_i`` of child poses ``xj[J, B, d_in]``, routing weights
    ``wr[J, d_in, m]`` and biases ``br[J, m]`` -> ``[J, B, m]``."""
    return torch.baddbmm(br.unsqueeze(1), xj, wr)  # [J, 1, m] + [J, B, d_in] @ [J, d_in, m]


class GatedPass(torch.autograd.Function):
    """The compiled loops' self-routing pass (capsctl/layers/backend/csrc/gated.cpp): ``(act[B, J],
    x[J, B, a, x], w[J, x, m, c], wr[J, a*x, m], br[J, m])`` -> the mass-weighted vote sum
    ``[B, m, a, c]``, the total mass ``[B, m]`` and the coefficients ``c[J, B, m]`` (not
    differentiable); the logits, the softmax, the mass and the votes formed pair by pair and
    never stored; keeps ``c``."""

    @staticmethod
    def forward(ctx, act: Tensor, x: Tensor, w: Tensor, wr: Tensor, br: Tensor) -> tuple:  # type: ignore[override]
        a, c = x.shape[2], w.shape[3]
        x, wc = prepare(x, w)  # [J, B, a, x], [J, x, c*m]
        # [B, J], [J, a*x, m], [J, m]
        act, wr, br = act.contiguous(), wr.contiguous(), br.contiguous()
        s, total, coef = bindings.gated_forward(x, wc, wr, br, act, c)
        ctx.save_for_backward(x, wc, wr, coef, act)
        ctx.mark_non_differentiable(coef)
        ctx.set_materialize_grads(False)  # no zero gradient of c (as large as c) is built
        return parent_major(s, a, c), total, coef  # [B, m, a, c], [B, m], [J, B, m]

    @staticmethod
    def backward(ctx, gs: Tensor | None, gt: Tensor | None, _gc: None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, wc, wr, coef, act = ctx.saved_tensors
        n = ctx.needs_input_grad
        _, bsz, a, _ = x.shape
        m = coef.shape[2]
        c = wc.shape[2] // m
        if gs is None:  # the poses unused
            gs = x.new_zeros(bsz, m, a, c)
        gt = x.new_zeros(bsz, m) if gt is None else gt  # the mass unused
        gs_q, gt = site_major(gs), gt.contiguous()  # [B, d, m], [B, m]
        needs = (n[0], n[1], n[2] or n[3] or n[4])
        gact, gx, gacc = bindings.gated_backward(x, wc, wr, coef, act, gs_q, gt, needs)
        if gacc is None:
            return gact, gx, None, None, None
        gwc, gwr, gbr = bindings.split_gated_weights(gacc, wc, wr)
        return gact, gx, unprepare_weights(gwc, c), gwr, gbr  # gw: [J, x, m, c]


def _triton_gate(xj: Tensor, wr: Tensor, br: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    from capsctl.layers.backend.triton.gate_ops import triton_gate

    return triton_gate(xj, wr, br, act)


def gated_pass(
    act: Tensor,
    x: Tensor,
    w: Tensor,
    wr: Tensor,
    br: Tensor,
    chunk_sites: int | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Self-routing of child activations ``act[B, J]`` and poses ``x[J, B, a, x]`` with pose
    weights ``w[J, x, m, c]``, routing weights ``wr[J, a*x, m]`` and biases ``br[J, m]`` ->
    parent poses ``u[B, m, a, c]``, parent activations ``[B, m]`` and the coefficients
    ``c[J, B, m]`` (detached).

    The logits are :func:`routing_logits`; the pose is ``sum_i c a u_hat / sum_i c a``: the
    numerator is :func:`~capsctl.layers.passes.weighted.weighted_pass` of the votes with weights
    ``c a`` (chunked, votes recomputed in the backward pass; dense when tracing or compiling),
    divided per parent afterwards, so no normalized ``[J, B, m]`` weights are built;
    ``chunk_sites``: sites per chunk (None: by its byte budget). On a CPU with the compiled loops
    (and no ``chunk_sites``) the logits, the coefficients, the mass and the weighted sum are one
    pass (:class:`GatedPass`), which keeps neither the logits nor the mass. Where the Triton
    kernels run (a GPU), the coefficients and the mass are one kernel of their own, which
    never stores the logits (capsctl/layers/backend/triton/gate.py; torch's operators if it
    fails), and the weighted sum is the Triton weighted pass (triton/kernels.py), since the
    coefficients depend on the child alone. ``autocast``: the
    16-bit dtype of an autocast block the caller left (its inputs are float32): where the
    Triton kernels run, the votes are built from 16-bit poses and weights (float32 sums), and
    the logits, the softmax and the mass stay in float32."""
    j, bsz, a, xd = x.shape
    choice = None  # asked once
    if chunk_sites is None:
        votes = VoteShape.of(x.shape, w.shape)
        choice = choose(act, x, w, wr, br, autocast=autocast, votes=votes)
    if choice is not None and choice.backend == "native":
        m, c = w.shape[2], w.shape[3]
        add_routing_flops(2 * j * bsz * a * xd * m)  # the logits (a matrix product in the pass)
        add_routing_flops(2 * j * bsz * m * a * c)  # the weighted sum
        u, total, coef = GatedPass.apply(act, x, w, wr, br)
        u = u / (total + SELF_ROUTING_EPS).unsqueeze(-1).unsqueeze(-1)  # [B, m, a, c]
        return u, parent_activations(total, act), coef
    triton = choice is not None and choice.backend == "triton"
    xj = x.reshape(j, bsz, a * xd)  # [J, B, a*x]
    gated = run_fused("gate", _triton_gate, xj, wr, br, act) if triton else None
    if gated is not None:
        coef, mass = gated  # [J, B, m] each: the logits never stored
    else:
        coef, mass = gate(routing_logits(xj, wr, br), act)  # [J, B, m] each
    total = mass.sum(0)  # [B, m]: sum_i c_ij a_i
    low = choice.dtype if choice is not None and (triton or choice.modelled) else None
    if low is not None and low != x.dtype:
        x, w = x.to(low), w.to(low)  # the votes in 16 bits; the mass stays float32
    u = weighted_pass(x, w, mass, chunk_sites, choice)  # [B, m, a, c]
    u = u / (total + SELF_ROUTING_EPS).unsqueeze(-1).unsqueeze(-1)  # [B, m, a, c]
    return u, parent_activations(total, act), coef.detach()
