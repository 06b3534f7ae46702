"""The routed pass of inverted dot-product attention routing, without the vote tensor.

The method is Tsai, Srivastava, Goh, Salakhutdinov, "Capsules with Inverted Dot-Product
Attention Routing" (ICLR 2020, arXiv:2002.04764): a child's votes are weighted by a softmax over
the *parents* of the dot products of its votes with the parents' poses of the previous iteration.

Letters, used in shape comments throughout capsctl:

- ``b`` batch items,
- ``n`` child capsule types, ``m`` parent capsule types,
- ``a``/``x`` rows/cols of a child pose matrix (``a = 1`` for vector poses),
  ``c`` cols of a parent pose matrix,
- ``d`` pose dim (a parent pose has ``d = a*c`` entries, a child pose ``a*x``),
- ``h,w`` output positions of a conv capsule layer (``H,W`` its input grid),
- ``k,l`` kernel offsets (rows and cols of a ``k x k`` window).

Both kinds of capsule layer reduce to one problem. Flatten every *parent site* (a batch item for
an FC layer, a batch item at one output position for a conv layer) into ``B`` and every child
that votes at that site (all child types, and for a conv layer all window offsets) into ``J``:

- child poses ``X[J, B, a, x]`` (a vector pose is a 1 x D_in matrix: ``a = 1``),
- weights ``W[J, x, m, c]`` (shared over ``B``),
- parent poses of the previous iteration ``P[B, m, a, c]``.

Votes are ``V[J, B, a, m, c] = sum_x X[J, B, a, x] W[J, x, m, c]``, the agreement is
``A[J, B, m] = scale * sum_{a,c} V * P``, the coefficients ``R = softmax_m(A)`` (each child's
coefficients sum to one over the parents at that site), and the result is
``S[B, m, a, c] = sum_J R * V``. The caller applies dropout and LayerNorm to ``S``.

Given ``G = d loss / d S``, the backward pass is (sums over ``a, c`` written over ``d``):
``dR = sum_d V * G``; ``dA = R * (dR - sum_m R * dR)`` (the softmax's backward);
``dV = R * G + scale * dA * P``; ``dP = scale * sum_J dA * V``; ``dX = dV W^T`` and
``dW = X^T dV`` summed over ``B``.

Three implementations of the same math sit side by side: :func:`routed_pass_reference` (einsum
over the full vote tensor; tests), :func:`routed_pass_dense` (one expression over the whole
batch; tracing and ``torch.compile``) and :class:`ChunkedRoutedPass` (eager autograd, the
default; its tiles run as the compiled loops where capsctl/layers/backend/dispatch.py says
``native``). :func:`routed_pass` picks one (:func:`capsctl.layers.backend.dispatch.choose`).

The chunked pass never keeps the vote tensor: it walks over ``B`` in chunks small enough to stay
in cache, keeps only the coefficients ``R`` (``1/d`` of the votes' size) and recomputes the
votes of each chunk in the backward pass. On a CPU the chunks of sites are shared between
threads, each running its chunks with single-threaded kernels (capsctl/layers/backend/chunks.py).

No input of the routed pass (``X``, ``W``, ``P``, nor the incoming gradient) is ever written to,
in the forward or the backward pass: in the concurrent schedule the parent poses of one layer
are the child poses of the next. Only buffers allocated here are updated in place.
"""

from __future__ import annotations

import functools

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

__all__ = ["ChunkedRoutedPass", "routed_pass", "routed_pass_dense", "routed_pass_reference"]


def routed_pass_reference(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The same computation with the full vote tensor (small inputs only; used by tests)."""
    v = torch.einsum("jbax,jxmc->jbamc", x, w)  # [J, B, a, m, c]
    logits = torch.einsum("jbamc,bmac->jbm", v, p) * scale  # [J, B, m]
    r = torch.softmax(logits, dim=-1)  # [J, B, m]
    s = torch.einsum("jbm,jbamc->bmac", r, v)  # [B, m, a, c]
    return s, r


def _chunked_forward(
    x: Tensor, w: Tensor, p: Tensor, scale: float, choice: Choice
) -> tuple[Tensor, Tensor]:
    """``S[B, m, a, c]`` and ``R[J, B, m]``, tile by tile (no autograd), on the compiled loops
    or the torch code as ``choice`` says."""
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    x, wc = prepare(x, w)
    pq = site_major(p, scale)  # [B, d, m], the agreement's scale folded in (new storage)
    if choice.backend == "native":
        sn, rn = bindings.routed_forward(x, wc, pq, c)  # [B, d, m], [J, B, m]
        return parent_major(sn, a, c), rn
    s = x.new_zeros(bsz, d, m)  # [B, d, m]
    r = x.new_empty(j, bsz, m)  # [J, B, m]
    jc, bc, spans = tile_plan(x, m, d, choice.sites or None)
    wcs = wc.split(jc)  # [Jc, x, c*m] each

    def part(_: int, lo: int, hi: int) -> None:
        buf = Chunk(x, jc, bc, a, d, m)
        for b0 in range(lo, hi, bc):
            b1 = min(hi, b0 + bc)
            pqc, sc = pq[b0:b1], s[b0:b1]  # [Bc, d, m]
            rs = r[:, b0:b1].split(jc)  # [Jc, Bc, m] each
            for t, xc in enumerate(x[:, b0:b1].split(jc)):  # [Jc, Bc, a, x]
                v = buf.votes(xc, wcs[t])  # [Jc, Bc, d, m]
                rc = buf.softmax_into(buf.dot_d(v, pqc), rs[t])  # [Jc, Bc, m]
                buf.sum_j(sc, v, rc)

    run_spans(part, spans)
    return parent_major(s, a, c), r


def _tile_backward(
    buf: Chunk,
    xc: Tensor,
    wct: Tensor,
    rc: Tensor,
    gqc: Tensor,
    pqc: Tensor,
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
    gx_tile: Tensor | None,
) -> None:
    """One ``(Jc, Bc)`` tile of the backward pass.

    ``xc[Jc, Bc, a, x]``, ``wct[Jc, x, c*m]``, ``rc[Jc, Bc, m]``, ``gqc[Bc, d, m]`` (d loss / d S),
    ``pqc[Bc, d, m]`` (``scale * P``); ``grads``: the tile's slices of the accumulators
    ``(gx[Jc, x, Bc*a], gw[Jc, x, c*m], gp[Bc, d, m])``, written to (gx) or added to (gw, gp).
    """
    gxc, gwc, gpc = grads
    v = buf.votes(xc, wct)  # [Jc, Bc, d, m]
    # d loss / d logits, without the scale (folded into pq and gp)
    da = buf.softmax_backward(rc, buf.dot_d(v, gqc))  # [Jc, Bc, m]
    if gpc is not None:
        buf.sum_j(gpc, v, da)
    if gxc is None and gwc is None:
        return
    gv = torch.mul(rc.unsqueeze(2), gqc, out=v)  # [Jc, Bc, d, m]
    gv.addcmul_(da.unsqueeze(2), pqc)  # [Jc, Bc, d, m]
    vote_backward(gv, xc, wct, gxc, gwc, gx_tile)


def _chunked_backward(
    x: Tensor,
    w: Tensor,
    p: Tensor,
    r: Tensor,
    gs: Tensor,
    scale: float,
    needs: tuple[bool, ...],
    choice: Choice,
) -> tuple[Tensor | None, ...]:
    """Gradients of ``X``, ``W`` and ``P`` from ``gs = d loss / d S``, recomputing the votes
    tile by tile, on the backend the forward pass's ``choice`` says. ``needs``: which of the
    three need a gradient."""
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    x, wc = prepare(x, w)
    pq = site_major(p, scale)  # [B, d, m]; d logits / d votes = scale * P (new storage)
    gq = site_major(gs)  # [B, d, m]
    if choice.backend == "native":
        gx, gwc, gpq = bindings.routed_backward(x, wc, pq, r, gq, c, needs[:3])
        return _native_grads(gx, gwc, gpq, a, c, scale)
    jc, bc, spans = tile_plan(x, m, d, choice.sites or None)
    acc = Gradients(x, wc, d, m, bc, jc, needs, len(spans))
    wcs = wc.split(jc)  # [Jc, x, c*m] each (per-child operands split once)

    def part(i: int, lo: int, hi: int) -> None:
        buf, gx_tile = Chunk(x, jc, bc, a, d, m), acc.scratch(i)
        gws = acc.gws[i].split(jc) if acc.gws else None  # [Jc, x, c*m] each
        for b0 in range(lo, hi, bc):
            b1 = min(hi, b0 + bc)
            gqc, pqc = gq[b0:b1], pq[b0:b1]  # [Bc, d, m]
            gpc = acc.gp[b0:b1] if acc.gp is not None else None  # [Bc, d, m]
            rs = r[:, b0:b1].split(jc)  # [Jc, Bc, m] each
            gxs = None
            if acc.gxt is not None:
                gxs = acc.gxt[:, :, b0 * a : b1 * a].split(jc)  # [Jc, x, Bc*a] each
            for t, xc in enumerate(x[:, b0:b1].split(jc)):  # [Jc, Bc, a, x]
                grads = (
                    gxs[t] if gxs is not None else None,
                    gws[t] if gws is not None else None,
                    gpc,
                )
                _tile_backward(buf, xc, wcs[t], rs[t], gqc, pqc, grads, gx_tile)

    run_spans(part, spans)
    return acc.of_inputs(a, c, scale)


def _native_grads(
    gx: Tensor | None, gwc: Tensor | None, gpq: Tensor | None, a: int, c: int, scale: float
) -> tuple[Tensor | None, ...]:
    """The compiled backward's ``gx[J, B, a, x]``, ``gw[J, x, c*m]`` and ``gp[B, d, m]``
    (before the scale) as the gradients of ``X``, ``W[J, x, m, c]`` and ``P[B, m, a, c]``."""
    gp = None if gpq is None else parent_major(gpq.mul_(scale), a, c)  # [B, m, a, c]
    return gx, unprepare_weights(gwc, c), gp


class ChunkedRoutedPass(torch.autograd.Function):
    """Autograd function for one routed pass; recomputes votes chunk by chunk in backward, on
    the backend its forward pass was given (``choice``, asked once by :func:`routed_pass`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, w: Tensor, p: Tensor, scale: float, choice: Choice
    ) -> tuple[Tensor, Tensor]:
        s, r = _chunked_forward(x, w, p, scale, choice)
        ctx.save_for_backward(x, w, p, r)
        ctx.scale, ctx.choice = scale, choice
        ctx.mark_non_differentiable(r)
        ctx.set_materialize_grads(False)  # no zero gradient of R (as large as R) is built
        return s, r

    @staticmethod
    def backward(ctx, gs: Tensor | None, _gr: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if gs is None:
            return None, None, None, None, None
        x, w, p, r = ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        gx, gw, gp = _chunked_backward(x, w, p, r, gs, ctx.scale, needs, ctx.choice)
        return gx, gw, gp, None, None


def routed_pass_dense(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The routed pass as one expression over the whole batch (materializes the votes).

    Same math as :func:`routed_pass`; used for tracing (``dispatch.use("dense")``: the chunked
    pass loops over the batch in Python, which tracing would unroll and specialize to one batch
    size) and by ``torch.compile``, whose fusion keeps the vote tensor from being stored.
    """
    j, bsz, a, xd = x.shape
    m, c = w.shape[2], w.shape[3]
    v = torch.matmul(x.reshape(j, bsz * a, xd), w.reshape(j, xd, m * c))  # [J, B*a, m*c]
    v = v.view(j, bsz, a, m, c)  # [J, B, a, m, c]
    pa = p.permute(0, 2, 1, 3).unsqueeze(0)  # [1, B, a, m, c]
    logits = (v * pa).sum(dim=(2, 4)) * scale  # [J, B, m]
    r = torch.softmax(logits, dim=-1)  # [J, B, m]
    s = (v * r[:, :, None, :, None]).sum(0)  # [B, a, m, c]
    return s.permute(0, 2, 1, 3), r  # [B, m, a, c], [J, B, m]


def _triton_routed(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    from capsctl.layers.backend.triton.ops import triton_routed

    return triton_routed(x, w, p, scale)


def routed_pass(
    x: Tensor, w: Tensor, p: Tensor, scale: float, choice: Choice | None = None
) -> tuple[Tensor, Tensor]:
    """One routed pass. ``x[J, B, a, x]``, ``w[J, x, m, c]``, ``p[B, m, a, c]``.

    Returns ``S[B, m, a, c]`` (the coefficient-weighted sum of votes, before dropout and
    LayerNorm) and the coefficients ``R[J, B, m]`` (detached). ``choice``: the pass's plan, if
    the caller asked capsctl/layers/backend/dispatch.py already (else it is asked here, once).
    """
    j, bsz, a, _ = x.shape
    # the agreement and the weighted sum: J*B*m*d multiply-accumulates each
    add_routing_flops(2 * 2 * j * bsz * w.shape[2] * a * w.shape[3])
    choice = choice or choose(x, w, p, votes=VoteShape.of(x.shape, w.shape))
    if choice.backend == "dense":
        s, r = routed_pass_dense(x, w, p, scale)
        return s, r.detach()
    if choice.backend == "triton":  # the fused kernels (capsctl/layers/backend/triton/)
        fused = run_fused("routed", functools.partial(_triton_routed, scale=scale), x, w, p)
        if fused is not None:
            # [B, m, a, c], [J, B, m] (not differentiable); R stays in the kernels' float32,
            # as every other backend returns it: a cast to the votes' 16-bit dtype would move
            # 1.5x R's bytes (347 MB a pass on cifar10-dynamic-simple at batch 128) for
            # coefficients that only traces read
            return fused
        choice = Choice("chunked", "the Triton kernel failed at these shapes")
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or p.requires_grad):
        s, r = ChunkedRoutedPass.apply(x, w, p, scale, choice)
        return s, r
    with torch.no_grad():
        return _chunked_forward(x, w, p, scale, choice)


def routed_pass_under_autocast(
    x: Tensor, w: Tensor, p: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """:func:`~capsctl.layers.passes.routed.routed_pass`, also under autocast: where the fused
    Triton kernels run it, in autocast's 16-bit dtype end to end (the kernels accumulate every
    sum and the softmax in float32 and round only the results); elsewhere in float32 (the
    compiled CPU loops and the torch code keep their buffers and softmax in float32)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return routed_pass(x, w, p, scale)
    votes = VoteShape.of(x.shape, w.shape)
    choice = choose(x, w, p, autocast=torch.get_autocast_dtype(device), votes=votes)
    dt = choice.dtype
    with torch.autocast(device_type=device, enabled=False):
        return routed_pass(x.to(dt), w.to(dt), p.to(dt), scale, choice)
