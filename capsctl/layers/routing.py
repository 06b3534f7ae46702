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


def _chunk_size(j: int, m: int, d: int, itemsize: int, total: int) -> int:
    per_site = max(1, j * m * d * itemsize)
    return max(1, min(total, CHUNK_BYTES // per_site))


def _votes(xc: Tensor, wf: Tensor, a: int, m: int, c: int) -> Tensor:
    """Votes of one chunk, laid out parent-major: ``[J, Bc, m, a*c]``."""
    j, bc = xc.shape[0], xc.shape[1]
    xd = xc.shape[3]
    v = torch.bmm(xc.reshape(j, bc * a, xd), wf)  # [J, Bc*a, m*c]
    v = v.view(j, bc, a, m, c).permute(0, 1, 3, 2, 4)  # [J, Bc, m, a, c]
    return v.reshape(j, bc, m, a * c)  # [J, Bc, m, d]


def routed_pass_reference(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """The same computation with the full vote tensor (small inputs only; used by tests)."""
    v = torch.einsum("jbax,jxmc->jbamc", x, w)  # [J, B, a, m, c]
    logits = torch.einsum("jbamc,bmac->jbm", v, p) * scale  # [J, B, m]
    r = torch.softmax(logits, dim=-1)  # [J, B, m]
    s = torch.einsum("jbm,jbamc->bmac", r, v)  # [B, m, a, c]
    return s, r


def _forward(x: Tensor, w: Tensor, p: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    j, bsz, a, xd = x.shape
    m, c = w.shape[2], w.shape[3]
    d = a * c
    wf = w.reshape(j, xd, m * c)  # [J, x, m*c]
    pf = p.reshape(bsz, m, d)  # [B, m, d]
    s = x.new_empty(bsz, m, d)
    r = x.new_empty(j, bsz, m)
    step = _chunk_size(j, m, d, x.element_size(), bsz)
    for b0 in range(0, bsz, step):
        b1 = min(bsz, b0 + step)
        v = _votes(x[:, b0:b1], wf, a, m, c)  # [J, Bc, m, d]
        logits = (v * pf[b0:b1]).sum(-1)  # [J, Bc, m]
        rc = torch.softmax(logits.mul_(scale), dim=-1)  # [J, Bc, m]
        r[:, b0:b1] = rc
        s[b0:b1] = (v * rc.unsqueeze(-1)).sum(0)  # [Bc, m, d]
    return s.view(bsz, m, a, c), r


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
        wf = w.reshape(j, xd, m * c)  # [J, x, m*c]
        wt = wf.transpose(1, 2)  # [J, m*c, x]
        pf = p.reshape(bsz, m, d)  # [B, m, d]
        gsf = gs.reshape(bsz, m, d)  # [B, m, d]
        need_x, need_w, need_p = ctx.needs_input_grad[:3]
        gx = torch.empty_like(x) if need_x else None
        gw = torch.zeros_like(wf) if need_w else None
        gp = torch.empty_like(pf) if need_p else None
        step = _chunk_size(j, m, d, x.element_size(), bsz)
        for b0 in range(0, bsz, step):
            b1 = min(bsz, b0 + step)
            bc = b1 - b0
            xc = x[:, b0:b1]  # [J, Bc, a, x]
            v = _votes(xc, wf, a, m, c)  # [J, Bc, m, d]
            rc = r[:, b0:b1]  # [J, Bc, m]
            gsc = gsf[b0:b1]  # [Bc, m, d]
            dr = (v * gsc).sum(-1)  # [J, Bc, m]
            # softmax backward over m, then the agreement's scale
            da = rc * (dr - (rc * dr).sum(-1, keepdim=True))  # [J, Bc, m]
            da.mul_(scale)
            if gp is not None:
                gp[b0:b1] = (v * da.unsqueeze(-1)).sum(0)  # [Bc, m, d]
            if gx is None and gw is None:
                continue
            gv = rc.unsqueeze(-1) * gsc  # [J, Bc, m, d]
            gv.addcmul_(da.unsqueeze(-1), pf[b0:b1])  # [J, Bc, m, d]
            gv = gv.view(j, bc, m, a, c).permute(0, 1, 3, 2, 4)  # [J, Bc, a, m, c]
            gv = gv.reshape(j, bc * a, m * c)  # [J, Bc*a, m*c]
            if gx is not None:
                gx[:, b0:b1] = torch.bmm(gv, wt).view(j, bc, a, xd)  # [J, Bc, a, x]
            if gw is not None:
                gw.baddbmm_(xc.reshape(j, bc * a, xd).transpose(1, 2), gv)  # [J, x, m*c]
        return (
            gx,
            gw.view_as(w) if gw is not None else None,
            gp.view_as(p) if gp is not None else None,
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
