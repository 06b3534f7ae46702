"""The weighted pass: votes summed with given coefficients, without the vote tensor.

For routings whose coefficients do not depend on the votes (self-routing, Hahn, Pyeon, Kim,
NeurIPS 2019): ``S[B, m, a, c] = sum_J R[J, B, m] V[J, B, a, m, c]`` with the votes ``V = X W``
of child poses ``X[J, B, a, x]`` and weights ``W[J, x, m, c]`` (letters and layouts as in
capsctl/layers/passes/routed.py). Backward, from ``G = d loss / d S``: ``dR = sum_d V G``,
``dV = R G``, ``dX = dV W^T``, ``dW = X^T dV``. Chunked as the routed pass: the votes of one
tile at a time, recomputed in the backward pass; only ``X``, ``W`` and ``R`` are kept.
"""

from __future__ import annotations

import torch
from torch import Tensor

from capsctl.layers.backend import bindings
from capsctl.layers.backend.chunks import run_spans, tile_plan
from capsctl.layers.backend.cost import VoteShape
from capsctl.layers.backend.dispatch import Choice, choose, run_fused
from capsctl.layers.passes.flops import add_routing_flops
from capsctl.layers.passes.tiles import (
    Chunk,
    Gradients,
    parent_major,
    prepare,
    site_major,
    unprepare_weights,
    vote_backward,
)

__all__ = ["ChunkedWeightedPass", "weighted_pass", "weighted_pass_dense"]


def _weighted_forward(x: Tensor, w: Tensor, r: Tensor, choice: Choice) -> Tensor:
    """``S[B, m, a, c] = sum_J R V``, tile by tile (no autograd), on the compiled loops or the
    torch code as ``choice`` says."""
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    x, wc = prepare(x, w)
    if choice.backend == "native":
        return parent_major(bindings.weighted_forward(x, wc, r.contiguous(), c), a, c)
    s = x.new_zeros(bsz, d, m)  # [B, d, m]
    jc, bc, spans = tile_plan(x, m, d, choice.sites or None)
    wcs = wc.split(jc)  # [Jc, x, c*m] each

    def part(_: int, lo: int, hi: int) -> None:
        buf = Chunk(x, jc, bc, a, d, m)
        for b0 in range(lo, hi, bc):
            b1 = min(hi, b0 + bc)
            rs = r[:, b0:b1].split(jc)  # [Jc, Bc, m] each
            for t, xc in enumerate(x[:, b0:b1].split(jc)):  # [Jc, Bc, a, x]
                buf.sum_j(s[b0:b1], buf.votes(xc, wcs[t]), rs[t])

    run_spans(part, spans)
    return parent_major(s, a, c)


def _weighted_backward(
    x: Tensor, w: Tensor, r: Tensor, gs: Tensor, choice: Choice, needs: tuple[bool, ...]
) -> tuple[Tensor | None, ...]:
    """Gradients of ``X``, ``W`` and ``R`` from ``gs = d loss / d S``: ``dR = sum_d V G``,
    ``dV = R G``, ``dX = dV W^T``, ``dW = X^T dV``, recomputing the votes tile by tile, on
    the backend the forward pass's ``choice`` says."""
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    x, wc = prepare(x, w)
    gq = site_major(gs)  # [B, d, m]
    if choice.backend == "native":
        gx, gwc, gr = bindings.weighted_backward(x, wc, r.contiguous(), gq, c, needs[:3])
        return gx, unprepare_weights(gwc, c), gr  # gw: [J, x, m, c]
    jc, bc, spans = tile_plan(x, m, d, choice.sites or None)
    acc = Gradients(x, wc, d, m, bc, jc, (needs[0], needs[1], False), len(spans))
    gr = x.new_empty(j, bsz, m) if needs[2] else None  # [J, B, m]
    wcs = wc.split(jc)  # [Jc, x, c*m] each

    def part(i: int, lo: int, hi: int) -> None:
        buf, gx_tile = Chunk(x, jc, bc, a, d, m), acc.scratch(i)
        gws = acc.gws[i].split(jc) if acc.gws else None  # [Jc, x, c*m] each
        for b0 in range(lo, hi, bc):
            b1 = min(hi, b0 + bc)
            gqc = gq[b0:b1]  # [Bc, d, m]
            rs = r[:, b0:b1].split(jc)  # [Jc, Bc, m] each
            grs = gr[:, b0:b1].split(jc) if gr is not None else None  # [Jc, Bc, m] each
            gxs = acc.gxt[:, :, b0 * a : b1 * a].split(jc) if acc.gxt is not None else None
            for t, xc in enumerate(x[:, b0:b1].split(jc)):  # [Jc, Bc, a, x]
                v = buf.votes(xc, wcs[t])  # [Jc, Bc, d, m]
                if grs is not None:
                    grs[t].copy_(buf.dot_d(v, gqc))  # [Jc, Bc, m]
                if gxs is None and gws is None:
                    continue
                gv = torch.mul(rs[t].unsqueeze(2), gqc, out=v)  # [Jc, Bc, d, m]
                gxc = gxs[t] if gxs is not None else None
                gwc = gws[t] if gws is not None else None
                vote_backward(gv, xc, wcs[t], gxc, gwc, gx_tile)

    run_spans(part, spans)
    gx, gw, _ = acc.of_inputs(a, c, 1.0)
    return gx, gw, gr


class ChunkedWeightedPass(torch.autograd.Function):
    """Autograd function for :func:`weighted_pass`; recomputes votes tile by tile in backward,
    on the backend its forward pass was given (``choice``)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, r: Tensor, choice: Choice) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, r)
        ctx.choice = choice
        return _weighted_forward(x, w, r, choice)

    @staticmethod
    def backward(ctx, gs: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w, r = ctx.saved_tensors
        gx, gw, gr = _weighted_backward(x, w, r, gs, ctx.choice, ctx.needs_input_grad[:3])
        return gx, gw, gr, None


def weighted_pass_dense(x: Tensor, w: Tensor, r: Tensor) -> Tensor:
    """:func:`weighted_pass` as one expression over the whole batch (materializes the votes)."""
    j, bsz, a, xd = x.shape
    m, c = w.shape[2], w.shape[3]
    v = torch.matmul(x.reshape(j, bsz * a, xd), w.reshape(j, xd, m * c))  # [J, B*a, m*c]
    v = v.view(j, bsz, a, m, c)  # [J, B, a, m, c]
    s = (v * r[:, :, None, :, None]).sum(0)  # [B, a, m, c]
    return s.permute(0, 2, 1, 3)  # [B, m, a, c]


def _triton_weighted(x: Tensor, w: Tensor, r: Tensor) -> Tensor:
    from capsctl.layers.backend.triton.ops import triton_weighted

    return triton_weighted(x, w, r)


def weighted_pass(
    x: Tensor, w: Tensor, r: Tensor, sites: int | None = None, choice: Choice | None = None
) -> Tensor:
    """The votes of ``x[J, B, a, x]`` under ``w[J, x, m, c]`` summed over the children with the
    coefficients ``r[J, B, m]``: ``S[B, m, a, c] = sum_J R V``, differentiable in all three, the
    votes never kept (for routings whose coefficients do not depend on the votes, such as
    self-routing). ``sites``: parent sites per tile of the torch code (None: by
    ``capsctl.layers.backend.chunks.tile_budget``; given, the torch code runs where the compiled
    loops would). ``choice``: the pass's plan, if the caller asked
    capsctl/layers/backend/dispatch.py already (else it is asked here, once)."""
    j, bsz, a, _ = x.shape
    add_routing_flops(2 * j * bsz * w.shape[2] * a * w.shape[3])  # the weighted sum
    choice = choice or choose(x, w, r, votes=VoteShape.of(x.shape, w.shape))
    if choice.backend == "dense":
        return weighted_pass_dense(x, w, r)
    if choice.backend == "triton":  # the fused kernels (capsctl/layers/backend/triton/)
        fused = run_fused("weighted", _triton_weighted, x, w, r)
        if fused is not None:
            return fused  # [B, m, a, c]
        choice = Choice("chunked", "the Triton kernel failed at these shapes")
    if sites is not None:
        choice = Choice("chunked", "parent sites per tile fixed by the caller", sites)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or r.requires_grad):
        return ChunkedWeightedPass.apply(x, w, r, choice)
    with torch.no_grad():
        return _weighted_forward(x, w, r, choice)
