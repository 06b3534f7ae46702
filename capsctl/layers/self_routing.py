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

The coefficients depend on the child alone, never on the votes, so the pose sum is a weighted
sum of votes with given weights ``w_ij = c_ij a_i / sum_i c_ij a_i``:
:func:`capsctl.layers.weighted_pass.weighted_pass`, which never keeps the votes (``B*m*J*d``
numbers) and recomputes them chunk by chunk in the backward pass. Only coefficient-sized tensors
(``[J, B, m]``, ``1/d`` of the votes) are kept for the backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from capsctl.layers.baseline_capsules import BaselineCapsules
from capsctl.layers.chunks import chunk_bytes, run_spans, site_spans, site_workers
from capsctl.layers.routing import _DENSE
from capsctl.layers.weighted_pass import weighted_pass

# Added to both denominators, sum_i a_i and sum_i c_ij a_i: a site whose children all have
# activation 0 (a sigmoid underflows to 0 in float32 below about -88), or a parent whose
# coefficients all underflow to 0, would otherwise give 0 / 0. Far below float32's resolution
# of any mass near 1, so it changes nothing else.
SELF_ROUTING_EPS = 1e-8


def _weights_dense(logits: Tensor, act: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``c = softmax_m(logits)``, ``w = c a / (sum_J c a + EPS)`` (both ``[J, B, m]``) and the
    parent activations ``sum_J c a / (sum_J a + EPS)`` ``[B, m]``, from ``logits[J, B, m]`` and
    the child activations ``act[B, J]``, as plain differentiable expressions (tracing)."""
    c = torch.softmax(logits, dim=-1)  # [J, B, m]
    mass = c * act.t().unsqueeze(-1)  # [J, B, m]: c_ij a_i
    total = mass.sum(0)  # [B, m]
    parent = total / (act.sum(-1, keepdim=True) + SELF_ROUTING_EPS)  # [B, m]
    return c, mass / (total + SELF_ROUTING_EPS), parent


# Bytes of one ``[J, Bc, m]`` chunk of the gating weights: the dozen passes over a chunk stay
# in cache (over the whole ``[J, B, m]`` they run at memory speed).
SELF_WEIGHTS_CHUNK_BYTES = 2**20


def _for_site_chunks(like: Tensor, body: Callable[[int, int], None]) -> None:
    """``body(b0, b1)`` for equal chunks of the sites ``B`` of ``like[J, B, m]``,
    ``SELF_WEIGHTS_CHUNK_BYTES`` each, shared by ``site_workers`` threads
    (capsctl/layers/chunks.py)."""
    j, bsz, m = like.shape
    budget, workers = chunk_bytes(like, SELF_WEIGHTS_CHUNK_BYTES), site_workers(like)
    bc = max(1, min(bsz, budget // max(1, j * m * like.element_size()), -(-bsz // workers)))
    bc = -(-bsz // -(-bsz // bc))

    def part(_: int, lo: int, hi: int) -> None:
        for b0 in range(lo, hi, bc):
            body(b0, min(hi, b0 + bc))

    run_spans(part, site_spans(bsz, bc, workers))


class SelfWeights(torch.autograd.Function):
    """:func:`_weights_dense` with a hand-written backward pass, chunk by chunk of sites: a
    few passes over each cache-sized chunk of ``[J, B, m]``, where autograd's broadcast products
    and quotients take many passes over the whole tensor.

    With ``A = sum_J a``, ``T = sum_J c a``, ``r = 1 / (T + EPS)``, ``w = c a r`` and
    ``P = T / (A + EPS)``, from ``gw = d loss / d w`` and ``gP = d loss / d P``:
    ``dT = -r sum_J gw w + gP / (A + EPS)``, ``q = d loss / d(c a) = gw r + dT``,
    ``dc = q a``, ``da = sum_m c q - sum_m gP T / (A + EPS)^2``, and the softmax's backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, act: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        at = act.t().contiguous()  # [J, B]
        c, w = torch.empty_like(logits), torch.empty_like(logits)  # [J, B, m] each
        total = logits.new_empty(logits.shape[1:])  # [B, m]

        def chunk(b0: int, b1: int) -> None:
            cc, wc = c[:, b0:b1], w[:, b0:b1]  # [J, Bc, m]
            cc.copy_(torch.softmax(logits[:, b0:b1], dim=-1))  # [J, Bc, m]
            torch.mul(cc, at[:, b0:b1].unsqueeze(-1), out=wc)  # [J, Bc, m]: c_ij a_i
            total[b0:b1] = wc.sum(0)  # [Bc, m]
            wc.div_(total[b0:b1] + SELF_ROUTING_EPS)  # [J, Bc, m]

        _for_site_chunks(logits, chunk)
        r = torch.reciprocal(total + SELF_ROUTING_EPS)  # [B, m]
        ra = torch.reciprocal(at.sum(0) + SELF_ROUTING_EPS).unsqueeze(-1)  # [B, 1]
        parent = total * ra  # [B, m]
        ctx.save_for_backward(c, at, w, r, ra, total)
        ctx.mark_non_differentiable(c)
        ctx.set_materialize_grads(False)
        return c, w, parent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, _gc: Tensor | None, gw: Tensor | None, gp: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        c, at, w, r, ra, total = ctx.saved_tensors
        dt = total.new_zeros(total.shape) if gp is None else gp * ra  # [B, m]
        da_parent = None if gp is None else (gp * total).sum(-1) * ra.squeeze(-1) ** 2  # [B]
        dlogits = torch.empty_like(c)  # [J, B, m]
        da = at.new_empty(at.shape)  # [J, B]

        def chunk(b0: int, b1: int) -> None:
            cc, atc, dtc = c[:, b0:b1], at[:, b0:b1].unsqueeze(-1), dt[b0:b1]  # chunk
            if gw is not None:
                gwc = gw[:, b0:b1]  # [J, Bc, m]
                dtc = dtc - r[b0:b1] * (gwc * w[:, b0:b1]).sum(0)  # [Bc, m]
                q = torch.addcmul(dtc.unsqueeze(0), gwc, r[b0:b1].unsqueeze(0))  # [J, Bc, m]
            else:
                q = dtc.unsqueeze(0).expand_as(cc)  # [J, Bc, m]
            da[:, b0:b1] = (cc * q).sum(-1)  # [J, Bc]
            dc = q * atc  # [J, Bc, m]
            dlogits[:, b0:b1] = torch._softmax_backward_data(dc, cc, -1, cc.dtype)  # [J, Bc, m]

        _for_site_chunks(c, chunk)
        if da_parent is not None:
            da.sub_(da_parent)  # [J, B] - [B]
        return dlogits, da.t()  # [J, B, m], [B, J]


def _weights(logits: Tensor, act: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """See :func:`_weights_dense`; :class:`SelfWeights` in eager autograd."""
    if _DENSE["on"] or torch.compiler.is_compiling():
        return _weights_dense(logits, act)
    return SelfWeights.apply(logits, act)


def self_route(
    logits: Tensor, act: Tensor, x: Tensor, w: Tensor, chunk_sites: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Self-routing of ``logits[J, B, m]`` (``W^route u_i + b^route``), child activations
    ``act[B, J]``, child poses ``x[J, B, a, x]`` and pose weights ``w[J, x, m, c]`` -> parent
    poses ``u[B, m, a, c]``, parent activations ``[B, m]`` and the coefficients ``c[J, B, m]``
    (detached). The pose sum is :func:`~capsctl.layers.weighted_pass.weighted_pass` (chunked, votes
    recomputed in the backward pass; dense when tracing or compiling); ``chunk_sites``: sites
    per chunk (None: by its byte budget)."""
    c, weights, parent = _weights(logits, act)
    u = weighted_pass(x, w, weights, chunk_sites)  # [B, m, a, c]
    return u, parent, c.detach()


class SelfRoutingCapsules(BaselineCapsules):
    """A capsule layer with self-routing (Hahn et al. 2019), matrix or vector poses.

    Parameters: ``weight`` (pose weights, as in :class:`BaselineCapsules`), ``route_weight``
    (``[k, l, n, d_in, m]`` conv, ``[n, d_in, m]`` FC) and ``route_bias`` (``[k, l, n, m]`` /
    ``[n, m]``). Init: pose weights ``N(0, m / (x * J))`` like
    :class:`capsctl.layers.capsules.CapsuleLayer`; routing weights and biases zero, so every
    coefficient starts uniform, ``1/m``. ``chunk_sites``: parent sites per chunk of the pose
    sum (None: from ``SELF_ROUTING_CHUNK_BYTES``).

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

    def logits(self, xs: Tensor) -> Tensor:
        """``W^route X + b^route`` for child poses ``xs[B, J, d_in]`` -> ``[J, B, m]``."""
        j, m = self.fan, self.out_types
        wr = self.route_weight.reshape(j, self.in_dim, m)  # [J, d_in, m]
        br = self.route_bias.reshape(j, 1, m)  # [J, 1, m]
        return torch.baddbmm(br, xs.transpose(0, 1), wr)  # [J, B, d_in] @ [J, d_in, m]

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
        xs, site = self.sites(child)  # [B, J, d_in]
        acts = self.child_activations(act)  # [B, J]
        if self.weight is None:
            c, _, parent = _weights(self.logits(xs), acts)  # [J, B, m], [B, m]
            coeffs = self.unsite_coefficients(c.detach().permute(1, 2, 0), site)  # from [B, m, J]
            return None, self.unsite(parent, site), coeffs
        bsz, j = xs.shape[0], self.fan
        a, xd, m, c = self.rows, self.cols_in, self.out_types, self.cols_out
        xj = xs.view(bsz, j, a, xd).transpose(0, 1)  # [J, B, a, x]
        wj = self.weight.reshape(j, xd, m, c)  # [J, x, m, c]
        u, parent, coef = self_route(self.logits(xs), acts, xj, wj, self.chunk_sites)
        poses = self.unsite(u.reshape(bsz, m, a * c), site)  # [b, h, w, m, d] / [b, m, d]
        coeffs = self.unsite_coefficients(coef.permute(1, 2, 0), site)  # from [B, m, J]
        return poses, self.unsite(parent, site), coeffs
