"""Self-routing capsule layer (Hahn, Pyeon, Kim, "Self-Routing Capsule Networks", NeurIPS 2019).

Letters and the site layout as in capsctl/layers/routing.py and
capsctl/layers/baseline_capsules.py: every parent site (a batch item for an FC layer, a batch
item at one output position for a conv layer) is flattened into ``B``, every child that votes at
that site (all child types, and for a conv layer all ``k x k`` window offsets) into ``J``.

Section 3 of the paper, per parent site, for its children ``i`` and parent types ``j``:

- votes ``u_hat_{j|i} = W^pose_ij u_i`` (a child pose is an ``a x x`` matrix and the vote is
  ``pose @ W``, as in :meth:`BaselineCapsules.votes`);
- coefficients from the child alone: ``c_ij = softmax_j((W^route_i u_i)_j + b^route_ij)``, the
  softmax over the ``m`` parent types of the site; ``W^route_i`` (``d_in x m``) and
  ``b^route_i`` are per child (per ``(k, l, n)`` in a conv layer, shared over positions);
- parent activation ``a_j = sum_i c_ij a_i / sum_i a_i``;
- parent pose ``u_j = sum_i c_ij a_i u_hat_{j|i} / sum_i c_ij a_i``.

A conv layer routes every output position's window on its own: a child that falls in several
windows has coefficients per window.

The coefficients depend on the child alone, never on the votes, so the pose's numerator is a
weighted sum of votes with given weights, the mass ``c_ij a_i``:
:func:`capsctl.layers.weighted_pass.weighted_pass`, which never keeps the votes (``B*m*J*d``
numbers) and recomputes them chunk by chunk in the backward pass; the division by
``sum_i c_ij a_i`` follows per parent (``[B, m]``). Only coefficient-sized tensors (``[J, B, m]``,
``1/d`` of the votes: ``c`` and the mass) are kept for the backward pass. The child poses are
laid out child-major (``[J, B, d_in]``, one copy of the windows), the layout both the routing
logits' and the votes' products per child read.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from capsctl.layers import native, native_passes
from capsctl.layers.baseline_capsules import BaselineCapsules
from capsctl.layers.flops import add_routing_flops
from capsctl.layers.routing import _DENSE
from capsctl.layers.vote_tiles import _parent_major, _prepare, _site_major, _unprepare_weights
from capsctl.layers.weighted_pass import weighted_pass

# Added to both denominators, sum_i a_i and sum_i c_ij a_i: a site whose children all have
# activation 0 (a sigmoid underflows to 0 in float32 below about -88), or a parent whose
# coefficients all underflow to 0, would otherwise give 0 / 0. Far below float32's resolution
# of any mass near 1, so it changes nothing else.
SELF_ROUTING_EPS = 1e-8


def _mass(logits: Tensor, act: Tensor) -> tuple[Tensor, Tensor]:
    """The coefficients ``c = softmax_m(logits)`` and the mass ``c a`` (``[J, B, m]`` each) of
    ``logits[J, B, m]`` and child activations ``act[B, J]``. Plain autograd: it keeps ``c``,
    and the weighted pass keeps the mass."""
    c = torch.softmax(logits, dim=-1)  # [J, B, m]
    return c, c * act.t().unsqueeze(-1)  # [J, B, m]: c_ij a_i


def _parent_activations(total: Tensor, act: Tensor) -> Tensor:
    """``sum_i c_ij a_i / sum_i a_i``: ``total[B, m]`` over ``act[B, J]``'s sum -> ``[B, m]``."""
    return total / (act.sum(-1, keepdim=True) + SELF_ROUTING_EPS)


def routing_logits(xj: Tensor, wr: Tensor, br: Tensor) -> Tensor:
    """``W^route_i u_i + b^route_i`` of child poses ``xj[J, B, d_in]``, routing weights
    ``wr[J, d_in, m]`` and biases ``br[J, m]`` -> ``[J, B, m]``."""
    return torch.baddbmm(br.unsqueeze(1), xj, wr)  # [J, 1, m] + [J, B, d_in] @ [J, d_in, m]


class GatedPass(torch.autograd.Function):
    """The compiled loops' self-routing pass (capsctl/layers/native.py): ``(act[B, J],
    x[J, B, a, x], w[J, x, m, c], wr[J, a*x, m], br[J, m])`` -> the mass-weighted vote sum
    ``[B, m, a, c]``, the total mass ``[B, m]`` and the coefficients ``c[J, B, m]`` (not
    differentiable); the logits, the softmax, the mass and the votes formed pair by pair and
    never stored; keeps ``c``."""

    @staticmethod
    def forward(ctx, act: Tensor, x: Tensor, w: Tensor, wr: Tensor, br: Tensor) -> tuple:  # type: ignore[override]
        a, c = x.shape[2], w.shape[3]
        x, wc = _prepare(x, w)  # [J, B, a, x], [J, x, c*m]
        # [B, J], [J, a*x, m], [J, m]
        act, wr, br = act.contiguous(), wr.contiguous(), br.contiguous()
        s, total, coef = native_passes.gated_forward(x, wc, wr, br, act, c)
        ctx.save_for_backward(x, wc, wr, coef, act)
        ctx.mark_non_differentiable(coef)
        ctx.set_materialize_grads(False)  # no zero gradient of c (as large as c) is built
        return _parent_major(s, a, c), total, coef  # [B, m, a, c], [B, m], [J, B, m]

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
        gs_q, gt = _site_major(gs), gt.contiguous()  # [B, d, m], [B, m]
        needs = (n[0], n[1], n[2] or n[3] or n[4])
        gact, gx, gacc = native_passes.gated_backward(x, wc, wr, coef, act, gs_q, gt, needs)
        if gacc is None:
            return gact, gx, None, None, None
        gwc, gwr, gbr = native_passes.split_gated_weights(gacc, wc, wr)
        return gact, gx, _unprepare_weights(gwc, c), gwr, gbr  # gw: [J, x, m, c]


def self_route(
    act: Tensor, x: Tensor, w: Tensor, wr: Tensor, br: Tensor, chunk_sites: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Self-routing of child activations ``act[B, J]`` and poses ``x[J, B, a, x]`` with pose
    weights ``w[J, x, m, c]``, routing weights ``wr[J, a*x, m]`` and biases ``br[J, m]`` ->
    parent poses ``u[B, m, a, c]``, parent activations ``[B, m]`` and the coefficients
    ``c[J, B, m]`` (detached).

    The logits are :func:`routing_logits`; the pose is ``sum_i c a u_hat / sum_i c a``: the
    numerator is :func:`~capsctl.layers.weighted_pass.weighted_pass` of the votes with weights
    ``c a`` (chunked, votes recomputed in the backward pass; dense when tracing or compiling),
    divided per parent afterwards, so no normalized ``[J, B, m]`` weights are built;
    ``chunk_sites``: sites per chunk (None: by its byte budget). On a CPU with the compiled loops
    (and no ``chunk_sites``) the logits, the coefficients, the mass and the weighted sum are one
    pass (:class:`GatedPass`), which keeps neither the logits nor the mass."""
    j, bsz, a, xd = x.shape
    if chunk_sites is None and not _DENSE["on"] and native.usable(act, x, w, wr, br):
        m, c = w.shape[2], w.shape[3]
        add_routing_flops(2 * j * bsz * a * xd * m)  # the logits (a matrix product in the pass)
        add_routing_flops(2 * j * bsz * m * a * c)  # the weighted sum
        u, total, coef = GatedPass.apply(act, x, w, wr, br)  # [B, m, a, c], [B, m], [J, B, m]
        u = u / (total + SELF_ROUTING_EPS).unsqueeze(-1).unsqueeze(-1)  # [B, m, a, c]
        return u, _parent_activations(total, act), coef
    logits = routing_logits(x.reshape(j, bsz, a * xd), wr, br)  # [J, B, m]
    coef, mass = _mass(logits, act)  # [J, B, m] each
    total = mass.sum(0)  # [B, m]: sum_i c_ij a_i
    u = weighted_pass(x, w, mass, chunk_sites)  # [B, m, a, c]
    u = u / (total + SELF_ROUTING_EPS).unsqueeze(-1).unsqueeze(-1)  # [B, m, a, c]
    return u, _parent_activations(total, act), coef.detach()


class SelfRoutingCapsules(BaselineCapsules):
    """A capsule layer with self-routing (Hahn et al. 2019), matrix or vector poses.

    Parameters: ``weight`` (pose weights, as in :class:`BaselineCapsules`), ``route_weight``
    (``[k, l, n, d_in, m]`` conv, ``[n, d_in, m]`` FC) and ``route_bias`` (``[k, l, n, m]`` /
    ``[n, m]``). Init: pose weights ``N(0, m / (x * J))`` like
    :class:`capsctl.layers.capsules.CapsuleLayer`; routing weights and biases zero, so every
    coefficient starts uniform, ``1/m``. ``chunk_sites``: parent sites per chunk of the pose
    sum (None: by the chunk budget of capsctl/layers/chunks.py).

    ``poses=False`` builds a layer whose parents carry activations only (the class capsules of
    Hahn et al., whose output is their activations): it has no pose weights (``weight`` is
    None) and routes no votes.
    """

    def __init__(
        self,
        kind: str,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        *,
        rows: int,
        kernel: int = 1,
        stride: int = 1,
        poses: bool = True,
    ) -> None:
        super().__init__(
            kind, in_types, in_dim, out_types, out_dim, rows=rows, kernel=kernel, stride=stride
        )
        lead = self.weight.shape[:-3]  # (k, l, n) or (n,)
        if not poses:
            self.weight = None  # type: ignore[assignment]
        self.route_weight = nn.Parameter(torch.empty(*lead, in_dim, out_types))
        self.route_bias = nn.Parameter(torch.empty(*lead, out_types))
        self.chunk_sites: int | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt(self.out_types / (self.cols_in * self.fan))
        with torch.no_grad():
            if self.weight is not None:
                self.weight.normal_(0.0, std)
            self.route_weight.zero_()
            self.route_bias.zero_()

    def routing_weights(self) -> tuple[Tensor, Tensor]:
        """``W^route`` as ``[J, d_in, m]`` and ``b^route`` as ``[J, m]``."""
        j, m = self.fan, self.out_types
        return self.route_weight.reshape(j, self.in_dim, m), self.route_bias.reshape(j, m)

    def route(self, child: Tensor, act: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        """Child poses ``[b, H, W, n, d_in]`` / ``[b, ..., d_in]`` and activations
        ``[b, H, W, n]`` / ``[b, ...]`` -> parent poses ``[b, h, w, m, d]`` / ``[b, m, d]``
        (None without pose weights),
        parent activations ``[b, h, w, m]`` / ``[b, m]`` and the coefficients (detached)
        ``[b, h, w, k, l, n, m]`` / ``[b, n, m]``. Runs in float32, also under autocast."""
        if torch.is_autocast_enabled(child.device.type):
            with torch.autocast(device_type=child.device.type, enabled=False):
                return self._route(child.float(), act.float())
        return self._route(child, act)

    def forward(self, child: Tensor, act: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        """Same as :meth:`route`."""
        return self.route(child, act)

    def _route(self, child: Tensor, act: Tensor) -> tuple[Tensor | None, Tensor, Tensor]:
        xj, site = self.child_sites(child)  # [J, B, d_in]
        acts = self.child_activations(act)  # [B, J]
        wr, br = self.routing_weights()  # [J, d_in, m], [J, m]
        if self.weight is None:
            c, mass = _mass(routing_logits(xj, wr, br), acts)  # [J, B, m] each
            parent = _parent_activations(mass.sum(0), acts)  # [B, m]
            coeffs = self.unsite_coefficients(c.detach().permute(1, 2, 0), site)  # from [B, m, J]
            return None, self.unsite(parent, site), coeffs
        j, bsz = xj.shape[0], xj.shape[1]
        a, xd, m, c = self.rows, self.cols_in, self.out_types, self.cols_out
        wj = self.weight.reshape(j, xd, m, c)  # [J, x, m, c]
        xp = xj.view(j, bsz, a, xd)  # [J, B, a, x]
        u, parent, coef = self_route(acts, xp, wj, wr, br, self.chunk_sites)
        poses = self.unsite(u.reshape(bsz, m, a * c), site)  # [b, h, w, m, d] / [b, m, d]
        coeffs = self.unsite_coefficients(coef.permute(1, 2, 0), site)  # from [B, m, J]
        return poses, self.unsite(parent, site), coeffs
