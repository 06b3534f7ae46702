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
default). :func:`routed_pass` picks one.

The chunked pass never keeps the vote tensor: it walks over ``B`` in chunks small enough to stay
in cache, keeps only the coefficients ``R`` (``1/d`` of the votes' size) and recomputes the
votes of each chunk in the backward pass.

No input of the routed pass (``X``, ``W``, ``P``, nor the incoming gradient) is ever written to,
in the forward or the backward pass: in the concurrent schedule the parent poses of one layer
are the child poses of the next. Only buffers allocated here are updated in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from capsctl.layers.chunks import chunk_bytes
from capsctl.layers.flops import add_routing_flops

# Bytes of vote chunk per step on a CPU, to stay in the last-level cache (accelerators: chunks.py).
CHUNK_BYTES = 2 * 2**20


def _tiles(
    j: int, bsz: int, m: int, d: int, itemsize: int, sites: int | None = None, budget: int = 0
) -> tuple[int, int]:
    """``(Jc, Bc)``: children and sites per chunk, so that a vote chunk fits in ``budget`` bytes
    (0: ``CHUNK_BYTES``; capsctl/layers/chunks.py); ``sites``: ``Bc`` given, for tests.

    Whole rows of sites come first: the votes of one child at many sites are one tall matrix
    product ``[Bc*a, x] @ [x, c*m]``, many times faster than many small products (``x`` is tiny).
    """
    per_site, budget = max(1, m * d * itemsize), budget or CHUNK_BYTES
    bc = max(1, min(bsz, sites or budget // per_site))
    bc = -(-bsz // -(-bsz // bc))  # equal chunks of sites, no short last one
    jc = max(1, min(j, budget // (per_site * bc)))
    return jc, bc


def _site_major(p: Tensor, scale: float = 1.0) -> Tensor:
    """``scale * p``: ``[B, m, a, c]`` -> contiguous ``[B, d, m]`` (parent type innermost, as the
    votes), one kernel.

    Always new storage, never a view of ``p`` (``.contiguous()`` would return ``p`` itself when
    ``m = 1`` or ``p`` is already laid out this way): callers may write to the result, and ``p``
    is an input of the routed pass, which must never change.
    """
    bsz, m, a, c = p.shape
    out = p.new_empty(bsz, a, c, m)  # [B, a, c, m]
    src = p.permute(0, 2, 3, 1)  # [B, a, c, m]
    if scale == 1.0:
        out.copy_(src)
    else:
        torch.mul(src, scale, out=out)
    return out.view(bsz, a * c, m)  # [B, d, m]


def _parent_major(q: Tensor, a: int, c: int) -> Tensor:
    """``[B, d, m]`` -> contiguous ``[B, m, a, c]``."""
    bsz, _, m = q.shape
    return q.view(bsz, a, c, m).permute(0, 3, 1, 2).contiguous()  # [B, m, a, c]


class _Chunk:
    """Scratch buffers for one ``(Jc, Bc)`` tile, reused by every tile (no allocator traffic)."""

    def __init__(self, like: Tensor, jc: int, bc: int, a: int, d: int, m: int) -> None:
        self.jc, self.bc, self.a, self.d, self.m = jc, bc, a, d, m
        n = jc * bc * d * m
        self.vbuf = like.new_empty(n)  # votes, then the votes' gradient
        self.tbuf = like.new_empty(n)  # products before a reduction over d
        self.lbuf = like.new_empty(jc * bc * m)  # logits / gradient of R
        self.rbuf = like.new_empty(jc * bc * m)  # coefficients of the tile
        self.kbuf = like.new_empty(jc * bc)  # one number per (child, site)

    def votes(self, xc: Tensor, wc: Tensor) -> Tensor:
        """``xc[Jc, Bc, a, x]``, ``wc[Jc, x, c*m]`` -> votes ``[Jc, Bc, d, m]`` (in ``vbuf``).

        Parent type innermost: the product needs no permute, coefficients ``[Jc, Bc, 1, m]``
        broadcast over contiguous rows and the agreement reduces a middle dim.
        """
        jc, bc, a, xd = xc.shape
        cm = wc.shape[2]
        v = self.vbuf[: jc * bc * a * cm].view(jc, bc * a, cm)  # [Jc, Bc*a, c*m]
        torch.bmm(xc.reshape(jc, bc * a, xd), wc, out=v)  # [Jc, Bc*a, c*m]
        return v.view(jc, bc, self.d, self.m)  # [Jc, Bc, d, m]

    def dot_d(self, v: Tensor, q: Tensor) -> Tensor:
        """``sum_d v * q``: ``v[Jc, Bc, d, m]``, ``q[Bc, d, m]`` -> ``[Jc, Bc, m]`` in ``lbuf``."""
        jc, bc = v.shape[0], v.shape[1]
        t = self.tbuf[: v.numel()].view_as(v)  # [Jc, Bc, d, m]
        torch.mul(v, q, out=t)  # [Jc, Bc, d, m]
        out = self.lbuf[: jc * bc * self.m].view(jc, bc, self.m)  # [Jc, Bc, m]
        return torch.sum(t, 2, out=out)  # [Jc, Bc, m]

    def softmax_into(self, logits: Tensor, dest: Tensor) -> Tensor:
        """Softmax over ``m`` of ``logits[Jc, Bc, m]`` written to ``dest`` (a slice of ``R``)."""
        if dest.is_contiguous():
            torch.ops.aten._softmax.out(logits, -1, False, out=dest)
            return dest
        out = self.rbuf[: logits.numel()].view_as(logits)  # [Jc, Bc, m]
        torch.ops.aten._softmax.out(logits, -1, False, out=out)
        dest.copy_(out)
        return out

    def softmax_backward(self, rc: Tensor, dr: Tensor) -> Tensor:
        """``rc * (dr - sum_m rc * dr)`` for ``rc, dr[Jc, Bc, m]``, one kernel (into ``rbuf``)."""
        out = self.rbuf[: dr.numel()].view_as(dr)  # [Jc, Bc, m]
        torch.ops.aten._softmax_backward_data.out(dr, rc, -1, dr.dtype, grad_input=out)
        return out

    def sum_j(self, acc: Tensor, v: Tensor, coef: Tensor) -> None:
        """``acc[Bc, d, m] += sum_J coef[Jc, Bc, m] * v[Jc, Bc, d, m]``; may overwrite ``v``."""
        if v.shape[0] == 1:
            acc.addcmul_(v[0], coef[0].unsqueeze(1))  # [Bc, d, m]
            return
        v.mul_(coef.unsqueeze(2))  # [Jc, Bc, d, m]
        t = self.tbuf[: acc.numel()].view_as(acc)  # [Bc, d, m]
        acc.add_(torch.sum(v, 0, out=t))  # [Bc, d, m]


def routed_pass_reference(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The same computation with the full vote tensor (small inputs only; used by tests)."""
    v = torch.einsum("jbax,jxmc->jbamc", x, w)  # [J, B, a, m, c]
    logits = torch.einsum("jbamc,bmac->jbm", v, p) * scale  # [J, B, m]
    r = torch.softmax(logits, dim=-1)  # [J, B, m]
    s = torch.einsum("jbm,jbamc->bmac", r, v)  # [B, m, a, c]
    return s, r


def _prepare(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Contiguous ``x[J, B, a, x]`` and the weights as ``[J, x, c*m]``."""
    j, xd, m, c = w.shape
    wc = w.permute(0, 1, 3, 2).contiguous().view(j, xd, c * m)  # [J, x, c*m]
    return x.contiguous(), wc


def _chunked_forward(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``S[B, m, a, c]`` and ``R[J, B, m]``, tile by tile (no autograd)."""
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    x, wc = _prepare(x, w)
    pq = _site_major(p, scale)  # [B, d, m], the agreement's scale folded in (new storage)
    s = x.new_zeros(bsz, d, m)  # [B, d, m]
    r = x.new_empty(j, bsz, m)  # [J, B, m]
    jc, bc = _tiles(j, bsz, m, d, x.element_size(), budget=chunk_bytes(x, CHUNK_BYTES))
    buf = _Chunk(x, jc, bc, a, d, m)
    wcs = wc.split(jc)  # [Jc, x, c*m] each
    for b0 in range(0, bsz, bc):
        b1 = min(bsz, b0 + bc)
        pqc, sc = pq[b0:b1], s[b0:b1]  # [Bc, d, m]
        rs = r[:, b0:b1].split(jc)  # [Jc, Bc, m] each
        for t, xc in enumerate(x[:, b0:b1].split(jc)):  # [Jc, Bc, a, x]
            v = buf.votes(xc, wcs[t])  # [Jc, Bc, d, m]
            rc = buf.softmax_into(buf.dot_d(v, pqc), rs[t])  # [Jc, Bc, m]
            buf.sum_j(sc, v, rc)
    return _parent_major(s, a, c), r


class _Gradients:
    """Gradient accumulators of the chunked backward pass, in the layouts its products write.

    ``gxt[J, x, B*a]``: d loss / d X transposed (the product ``[x, c*m] @ [c*m, Bc*a]`` runs
    faster than its transpose); ``gw[J, x, c*m]``; ``gp[B, d, m]`` before the agreement's scale.
    Each is None when its input needs no gradient. ``gx_tile``: a scratch tile for ``gxt`` when a
    tile of sites is not a contiguous slice of it (``Bc < B``).
    """

    def __init__(
        self, x: Tensor, wc: Tensor, d: int, m: int, bc: int, jc: int, needs: tuple[bool, ...]
    ) -> None:
        j, bsz, a, xd = x.shape
        need_x, need_w, need_p = needs[:3]
        self.gxt = x.new_empty(j, xd, bsz * a) if need_x else None  # [J, x, B*a]
        self.gw = torch.zeros_like(wc) if need_w else None  # [J, x, c*m]
        self.gp = x.new_zeros(bsz, d, m) if need_p else None  # [B, d, m]
        self.gx_tile = x.new_empty(jc * xd * bc * a) if need_x and bc < bsz else None

    def of_inputs(self, a: int, c: int, scale: float) -> tuple[Tensor | None, ...]:
        """The gradients of ``X[J, B, a, x]``, ``W[J, x, m, c]`` and ``P[B, m, a, c]``."""
        gx = gw = gp = None
        if self.gxt is not None:
            j, xd, ba = self.gxt.shape
            # a strided view is a valid gradient: no copy back to [J, B, a, x]
            gx = self.gxt.view(j, xd, ba // a, a).permute(0, 2, 3, 1)  # [J, B, a, x]
        if self.gw is not None:
            j, xd, cm = self.gw.shape
            gw = self.gw.view(j, xd, c, cm // c).permute(0, 1, 3, 2).contiguous()  # [J, x, m, c]
        if self.gp is not None:
            gp = _parent_major(self.gp.mul_(scale), a, c)  # [B, m, a, c]
        return gx, gw, gp


def _tile_backward(
    buf: _Chunk,
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
    _vote_backward(gv, xc, wct, gxc, gwc, gx_tile)


def _vote_backward(
    gv: Tensor,
    xc: Tensor,
    wct: Tensor,
    gxc: Tensor | None,
    gwc: Tensor | None,
    gx_tile: Tensor | None,
) -> None:
    """From the votes' gradient ``gv[Jc, Bc, d, m]`` of one tile: writes ``d X`` (transposed,
    ``gxc[Jc, x, Bc*a]``) and adds ``d W`` to ``gwc[Jc, x, c*m]``."""
    tj, tb, a, xd = xc.shape
    cm = wct.shape[2]
    gv = gv.view(tj, tb * a, cm)  # [Jc, Bc*a, c*m]
    if gxc is not None:
        gvt = gv.transpose(1, 2)  # [Jc, c*m, Bc*a]
        if gx_tile is None:
            torch.bmm(wct, gvt, out=gxc)  # [Jc, x, Bc*a]
        else:
            tile = gx_tile[: tj * xd * tb * a].view(tj, xd, tb * a)  # [Jc, x, Bc*a]
            gxc.copy_(torch.bmm(wct, gvt, out=tile))  # [Jc, x, Bc*a]
    if gwc is not None:
        xct = xc.reshape(tj, tb * a, xd).transpose(1, 2)  # [Jc, x, Bc*a]
        gwc.baddbmm_(xct, gv)  # [Jc, x, c*m]


def _chunked_backward(
    x: Tensor, w: Tensor, p: Tensor, r: Tensor, gs: Tensor, scale: float, needs: tuple[bool, ...]
) -> tuple[Tensor | None, ...]:
    """Gradients of ``X``, ``W`` and ``P`` from ``gs = d loss / d S``, recomputing the votes
    tile by tile. ``needs``: which of the three need a gradient."""
    j, bsz, a, _ = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    x, wc = _prepare(x, w)
    pq = _site_major(p, scale)  # [B, d, m]; d logits / d votes = scale * P (new storage)
    gq = _site_major(gs)  # [B, d, m]
    jc, bc = _tiles(j, bsz, m, d, x.element_size(), budget=chunk_bytes(x, CHUNK_BYTES))
    buf = _Chunk(x, jc, bc, a, d, m)
    acc = _Gradients(x, wc, d, m, bc, jc, needs)
    # per-child operands split once (one call each, not one slice per tile)
    wcs = wc.split(jc)  # [Jc, x, c*m] each
    gws = acc.gw.split(jc) if acc.gw is not None else None  # [Jc, x, c*m] each
    for b0 in range(0, bsz, bc):
        b1 = min(bsz, b0 + bc)
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
            _tile_backward(buf, xc, wcs[t], rs[t], gqc, pqc, grads, acc.gx_tile)
    return acc.of_inputs(a, c, scale)


class ChunkedRoutedPass(torch.autograd.Function):
    """Autograd function for one routed pass; recomputes votes chunk by chunk in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        s, r = _chunked_forward(x, w, p, scale)
        ctx.save_for_backward(x, w, p, r)
        ctx.scale = scale
        ctx.mark_non_differentiable(r)
        ctx.set_materialize_grads(False)  # no zero gradient of R (as large as R) is built
        return s, r

    @staticmethod
    def backward(ctx, gs: Tensor | None, _gr: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        if gs is None:
            return None, None, None, None
        x, w, p, r = ctx.saved_tensors
        gx, gw, gp = _chunked_backward(x, w, p, r, gs, ctx.scale, ctx.needs_input_grad[:3])
        return gx, gw, gp, None


_DENSE = {"on": False}


@contextlib.contextmanager
def dense_routing() -> Iterator[None]:
    """Use :func:`routed_pass_dense` inside the block (tracing for ONNX and torch.export).

    The chunked pass loops over the batch in Python, which tracing would unroll and specialize
    to one batch size; the dense formula is one expression for any batch size.
    """
    before = _DENSE["on"]
    _DENSE["on"] = True
    try:
        yield
    finally:
        _DENSE["on"] = before


def routed_pass_dense(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The routed pass as one expression over the whole batch (materializes the votes).

    Same math as :func:`routed_pass`; used for tracing and by ``torch.compile``, whose fusion
    keeps the vote tensor from being stored.
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


def routed_pass(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One routed pass. ``x[J, B, a, x]``, ``w[J, x, m, c]``, ``p[B, m, a, c]``.

    Returns ``S[B, m, a, c]`` (the coefficient-weighted sum of votes, before dropout and
    LayerNorm) and the coefficients ``R[J, B, m]`` (detached).
    """
    j, bsz, a, _ = x.shape
    # the agreement and the weighted sum: J*B*m*d multiply-accumulates each
    add_routing_flops(2 * 2 * j * bsz * w.shape[2] * a * w.shape[3])
    if _DENSE["on"] or torch.compiler.is_compiling():
        s, r = routed_pass_dense(x, w, p, scale)
        return s, r.detach()
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or p.requires_grad):
        s, r = ChunkedRoutedPass.apply(x, w, p, scale)
        return s, r
    with torch.no_grad():
        return _chunked_forward(x, w, p, scale)
