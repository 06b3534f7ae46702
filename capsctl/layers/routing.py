"""The routed pass of inverted dot-product attention routing, without the vote tensor.

Letters (REFERENCE.md §1): ``b`` batch, ``n`` child capsule types, ``m`` parent capsule types,
``a``/``x`` rows/cols of a child pose matrix, ``c`` cols of a parent pose matrix (the parent pose
dim is ``d = a*c``), ``h,w`` output positions, ``k,l`` kernel offsets.

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

The vote tensor is never kept: :class:`RoutedPass` walks over ``B`` in chunks small enough to
stay in cache, keeps only the coefficients ``R`` (``1/d`` of the votes' size) and recomputes the
votes of each chunk in the backward pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Bytes of vote chunk per step; chosen so that the chunk stays in the last-level cache.
CHUNK_BYTES = 4 * 2**20


def _tiles(j: int, bsz: int, m: int, d: int, itemsize: int) -> tuple[int, int]:
    """``(Jc, Bc)``: children and sites per chunk, so that a vote chunk fits in ``CHUNK_BYTES``.

    Whole rows of sites come first: the votes of one child at many sites are one tall matrix
    product ``[Bc*a, x] @ [x, c*m]``, many times faster than many small products (``x`` is tiny).
    """
    per_site = max(1, m * d * itemsize)
    bc = max(1, min(bsz, CHUNK_BYTES // per_site))
    jc = max(1, min(j, CHUNK_BYTES // (per_site * bc)))
    return jc, bc


def _votes(xc: Tensor, wc: Tensor, m: int, buf: Tensor) -> Tensor:
    """Votes of one chunk written into ``buf``, laid out ``[Jc, Bc, a*c, m]``.

    ``xc[Jc, Bc, a, x]``, ``wc[Jc, x, c*m]``. The parent type is innermost, so no permute is
    needed, coefficients ``[Jc, Bc, 1, m]`` broadcast over a contiguous row, and the agreement
    reduces the middle dim.
    """
    jc, bc, a, xd = xc.shape
    cm = wc.shape[2]
    v = buf[: jc * bc * a * cm].view(jc, bc * a, cm)  # [Jc, Bc*a, c*m]
    torch.bmm(xc.reshape(jc, bc * a, xd), wc, out=v)  # [Jc, Bc*a, c*m]
    return v.view(jc, bc, a * cm // m, m)  # [Jc, Bc, d, m]


def _dot_d(v: Tensor, q: Tensor, buf: Tensor) -> Tensor:
    """``sum_d v * q`` for ``v[Jc, Bc, d, m]``, ``q[Bc, d, m]``, using ``buf`` as scratch."""
    t = buf[: v.numel()].view_as(v)  # [Jc, Bc, d, m]
    torch.mul(v, q, out=t)  # [Jc, Bc, d, m]
    return t.sum(2)  # [Jc, Bc, m]


def _sum_j(acc: Tensor, v: Tensor, coef: Tensor) -> None:
    """``acc += sum_J coef * v`` for ``acc[Bc, d, m]``, ``v[Jc, Bc, d, m]``, ``coef[Jc, Bc, m]``;
    overwrites ``v``."""
    if v.shape[0] == 1:
        acc.addcmul_(v[0], coef[0].unsqueeze(1))  # [Bc, d, m]
    else:
        v.mul_(coef.unsqueeze(2))  # [Jc, Bc, d, m]
        acc.add_(v.sum(0))  # [Bc, d, m]


def routed_pass_reference(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The same computation with the full vote tensor (small inputs only; used by tests)."""
    v = torch.einsum("jbax,jxmc->jbamc", x, w)  # [J, B, a, m, c]
    logits = torch.einsum("jbamc,bmac->jbm", v, p) * scale  # [J, B, m]
    r = torch.softmax(logits, dim=-1)  # [J, B, m]
    s = torch.einsum("jbm,jbamc->bmac", r, v)  # [B, m, a, c]
    return s, r


def _weights_cm(w: Tensor) -> Tensor:
    j, xd, m, c = w.shape
    return w.permute(0, 1, 3, 2).reshape(j, xd, c * m)  # [J, x, c*m]


def _site_major(p: Tensor) -> Tensor:
    bsz, m, a, c = p.shape
    return p.permute(0, 2, 3, 1).reshape(bsz, a * c, m)  # [B, d, m]


def _forward(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    j, bsz, a, xd = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    x = x.contiguous()
    wc = _weights_cm(w)  # [J, x, c*m]
    pq = _site_major(p)  # [B, d, m]
    s = x.new_zeros(bsz, d, m)  # [B, d, m]
    r = x.new_empty(j, bsz, m)  # [J, B, m]
    jc, bc = _tiles(j, bsz, m, d, x.element_size())
    vbuf = x.new_empty(jc * bc * d * m)
    tbuf = x.new_empty(jc * bc * d * m)
    for b0 in range(0, bsz, bc):
        b1 = min(bsz, b0 + bc)
        for j0 in range(0, j, jc):
            j1 = min(j, j0 + jc)
            v = _votes(x[j0:j1, b0:b1], wc[j0:j1], m, vbuf)  # [Jc, Bc, d, m]
            logits = _dot_d(v, pq[b0:b1], tbuf)  # [Jc, Bc, m]
            rc = torch.softmax(logits.mul_(scale), dim=-1)  # [Jc, Bc, m]
            r[j0:j1, b0:b1] = rc
            _sum_j(s[b0:b1], v, rc)
    s = s.view(bsz, a, c, m).permute(0, 3, 1, 2).contiguous()  # [B, m, a, c]
    return s, r


class RoutedPass(torch.autograd.Function):
    """Autograd function for one routed pass; recomputes votes chunk by chunk in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        s, r = _forward(x, w, p, scale)
        ctx.save_for_backward(x, w, p, r)
        ctx.scale = scale
        ctx.mark_non_differentiable(r)
        return s, r

    @staticmethod
    def backward(ctx, gs: Tensor, _gr: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w, p, r = ctx.saved_tensors
        scale: float = ctx.scale
        j, bsz, a, xd = x.shape
        m, c = w.shape[2], w.shape[3]
        d = a * c
        x = x.contiguous()
        wc = _weights_cm(w)  # [J, x, c*m]
        wt = wc.transpose(1, 2)  # [J, c*m, x]
        pq = _site_major(p)  # [B, d, m]
        gq = _site_major(gs)  # [B, d, m]
        need_x, need_w, need_p = ctx.needs_input_grad[:3]
        gx = torch.empty_like(x) if need_x else None  # [J, B, a, x]
        gw = torch.zeros_like(wc) if need_w else None  # [J, x, c*m]
        gp = x.new_zeros(bsz, d, m) if need_p else None  # [B, d, m]
        jc, bc = _tiles(j, bsz, m, d, x.element_size())
        vbuf = x.new_empty(jc * bc * d * m)
        tbuf = x.new_empty(jc * bc * d * m)
        for b0 in range(0, bsz, bc):
            b1 = min(bsz, b0 + bc)
            for j0 in range(0, j, jc):
                j1 = min(j, j0 + jc)
                xc = x[j0:j1, b0:b1]  # [Jc, Bc, a, x]
                v = _votes(xc, wc[j0:j1], m, vbuf)  # [Jc, Bc, d, m]
                rc = r[j0:j1, b0:b1]  # [Jc, Bc, m]
                dr = _dot_d(v, gq[b0:b1], tbuf)  # [Jc, Bc, m]
                # softmax backward over m, then the agreement's scale
                da = rc * (dr - (rc * dr).sum(-1, keepdim=True))  # [Jc, Bc, m]
                da.mul_(scale)
                if gp is not None:
                    _sum_j(gp[b0:b1], v, da)
                if gx is None and gw is None:
                    continue
                gv = torch.mul(rc.unsqueeze(2), gq[b0:b1], out=v)  # [Jc, Bc, d, m]
                gv.addcmul_(da.unsqueeze(2), pq[b0:b1])  # [Jc, Bc, d, m]
                gv = gv.view(j1 - j0, (b1 - b0) * a, c * m)  # [Jc, Bc*a, c*m]
                if gx is not None:
                    gx[j0:j1, b0:b1] = torch.bmm(gv, wt[j0:j1]).view(j1 - j0, b1 - b0, a, xd)  # [Jc, Bc, a, x]
                if gw is not None:
                    gw[j0:j1].baddbmm_(xc.reshape(j1 - j0, (b1 - b0) * a, xd).transpose(1, 2), gv)  # [Jc, x, c*m]
        return (
            gx,
            gw.view(j, xd, c, m).permute(0, 1, 3, 2).contiguous() if gw is not None else None,  # [J, x, m, c]
            gp.view(bsz, a, c, m).permute(0, 3, 1, 2).contiguous() if gp is not None else None,  # [B, m, a, c]
            None,
        )


def routed_pass(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """One routed pass. ``x[J, B, a, x]``, ``w[J, x, m, c]``, ``p[B, m, a, c]``.

    Returns ``S[B, m, a, c]`` (the coefficient-weighted sum of votes, before dropout and
    LayerNorm) and the coefficients ``R[J, B, m]`` (detached).
    """
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or p.requires_grad):
        s, r = RoutedPass.apply(x, w, p, scale)
        return s, r
    with torch.no_grad():
        return _forward(x, w, p, scale)
