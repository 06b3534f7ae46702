"""Tiles of the vote tensor: the buffers and products the chunked passes share.

The routed pass (capsctl/layers/passes/routed.py) and the weighted pass
(capsctl/layers/passes/weighted.py) walk over ``(Jc, Bc)`` tiles of the votes
``V[J, B, d, m]`` (letters as in capsctl/layers/passes/routed.py): this module holds the per-tile
scratch buffers (:class:`Chunk`), the layouts the products want (:func:`prepare`,
:func:`site_major`, :func:`parent_major`), the gradient accumulators (:class:`Gradients`) and
the backward pass of the votes' product (:func:`vote_backward`). How large a tile is and which
thread runs it is capsctl/layers/backend/chunks.py's (:func:`~capsctl.layers.backend.chunks.
tile_plan`): the tiling has one home.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "Chunk",
    "Gradients",
    "parent_major",
    "prepare",
    "site_major",
    "unprepare_weights",
    "vote_backward",
]


def site_major(p: Tensor, scale: float = 1.0) -> Tensor:
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


def parent_major(q: Tensor, a: int, c: int) -> Tensor:
    """``[B, d, m]`` -> contiguous ``[B, m, a, c]``."""
    bsz, _, m = q.shape
    return q.view(bsz, a, c, m).permute(0, 3, 1, 2).contiguous()  # [B, m, a, c]


class Chunk:
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


def prepare(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Contiguous ``x[J, B, a, x]`` and the weights as ``[J, x, c*m]``."""
    j, xd, m, c = w.shape
    wc = w.permute(0, 1, 3, 2).contiguous().view(j, xd, c * m)  # [J, x, c*m]
    return x.contiguous(), wc


def unprepare_weights(gwc: Tensor | None, c: int) -> Tensor | None:
    """A weight-shaped tensor from :func:`prepare`'s layout back to the weights':
    ``[J, x, c*m]`` -> contiguous ``[J, x, m, c]`` (None stays None)."""
    if gwc is None:
        return None
    j, xd, cm = gwc.shape
    return gwc.view(j, xd, c, cm // c).permute(0, 1, 3, 2).contiguous()  # [J, x, m, c]


class Gradients:
    """Gradient accumulators of the chunked backward pass, in the layouts its products write.

    ``gxt[J, x, B*a]``: d loss / d X transposed (the product ``[x, c*m] @ [c*m, Bc*a]`` runs
    faster than its transpose); ``gw[J, x, c*m]``; ``gp[B, d, m]`` before the agreement's scale.
    Each is None when its input needs no gradient. ``gx_tile``: a scratch tile for ``gxt`` when a
    tile of sites is not a contiguous slice of it (``Bc < B``).
    """

    def __init__(
        self,
        x: Tensor,
        wc: Tensor,
        d: int,
        m: int,
        bc: int,
        jc: int,
        needs: tuple[bool, ...],
        parts: int = 1,
    ) -> None:
        j, bsz, a, xd = x.shape
        need_x, need_w, need_p = needs[:3]
        self.gxt = x.new_empty(j, xd, bsz * a) if need_x else None  # [J, x, B*a]
        self.gw = torch.zeros_like(wc) if need_w else None  # [J, x, c*m]
        # one d W accumulator per thread sharing the sites, summed in of_inputs
        self.gws = [self.gw] + [torch.zeros_like(wc) for _ in range(parts - 1)] if need_w else []
        self.gp = x.new_zeros(bsz, d, m) if need_p else None  # [B, d, m]
        self.tile_numel = jc * xd * bc * a if need_x and bc < bsz else 0

    def scratch(self, part: int) -> Tensor | None:
        """A ``gx`` tile for one thread's tiles when a tile of sites is not a contiguous slice
        of ``gxt`` (``Bc < B``)."""
        if self.gxt is None or not self.tile_numel:
            return None
        return self.gxt.new_empty(self.tile_numel)

    def of_inputs(self, a: int, c: int, scale: float) -> tuple[Tensor | None, ...]:
        """The gradients of ``X[J, B, a, x]``, ``W[J, x, m, c]`` and ``P[B, m, a, c]``."""
        gx = gw = gp = None
        if self.gxt is not None:
            j, xd, ba = self.gxt.shape
            # a strided view is a valid gradient: no copy back to [J, B, a, x]
            gx = self.gxt.view(j, xd, ba // a, a).permute(0, 2, 3, 1)  # [J, B, a, x]
        if self.gw is not None:
            for extra in self.gws[1:]:
                self.gw.add_(extra)
            gw = unprepare_weights(self.gw, c)  # [J, x, m, c]
        if self.gp is not None:
            gp = parent_major(self.gp.mul_(scale), a, c)  # [B, m, a, c]
        return gx, gw, gp


def vote_backward(
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
