"""The vote-sized work of EM routing, chunk by chunk, without keeping the vote tensor.

EM routing (Hinton, Sabour, Frosst, "Matrix capsules with EM routing", ICLR 2018) touches the
votes ``V_ij = X_i W_ij`` in two places only, both linear in a coefficient-sized operand:

- the M-step's moments ``S1[B, m, d] = sum_J r V'`` and ``S2 = sum_J r V'^2``
  (:class:`VoteMoments`, operand ``r[B, J, m]``, the assignments times the child activations,
  formed chunk by chunk), and
- the E-step's quadratic form ``Q[B, J, m] = sum_d (q V' + p V'^2)``
  (:class:`VoteQuad`, operands ``q, p[B, m, d]``),

where ``V' = V - s`` are the votes about a fixed shift ``s[B, m, d]`` (:func:`vote_shift`; a
constant, so the moments about it give the same function of the inputs and the same gradients,
while ``E[V'^2] - E[V']^2`` loses far fewer digits than ``E[V^2] - E[V]^2``). The backward of
each is the other: ``dr = sum_d (gS1 V' + gS2 V'^2)``, ``d(q, p) = sum_J gQ (V', V'^2)``, and
``dV = r (gS1 + 2 V' gS2)`` (moments) or ``gQ (q + 2 V' p)`` (quadratic form), from which
``dX = dV W^T`` and ``dW = X^T dV`` are two batched matrix products.

Both walk over the parent sites ``B`` in chunks small enough to stay in cache, build the votes of
a chunk with one batched product, and keep only coefficient-sized tensors (``r``, ``q``, ``p``,
the child poses) for the backward pass, which builds each chunk's votes again.

Letters as in capsctl/layers/passes/routed.py. Layouts inside: child poses ``x[J, B, a, x]``,
weights ``wc[J, x, c*m]`` (parent type innermost), shift ``[B, d, m]``, a chunk of votes and squared
votes ``U[2, J, Bc, d, m]`` (``d = (a, c)``), coefficients ``[J, Bc, m]`` per chunk (``[B, J, m]``
as inputs and outputs: a pair's ``m`` values side by side, as the compiled loops read and write
them; ``[B, m, J]`` put them ``J`` floats apart, which cost the loops 10-30% of their time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from capsctl.layers.backend import bindings
from capsctl.layers.backend.chunks import run_spans, site_spans, site_workers, vote_chunk_bytes
from capsctl.layers.backend.dispatch import Choice, choose, run_fused

__all__ = [
    "EM_CHUNK_BYTES",
    "VoteMoments",
    "VoteQuad",
    "pose_layout",
    "vote_moments",
    "vote_quad",
    "vote_shift",
]

# Bytes of votes per chunk of parent sites on a CPU; 0 (the default): chunks.py decides.
EM_CHUNK_BYTES = 0


def _chunk_sites(bsz: int, per_site: int, budget: int, workers: int = 1, sites: int = 0) -> int:
    """Sites per chunk: ``sites`` when > 0 (``dispatch.use("chunked", sites=...)``), else as
    many as ``budget`` bytes of votes hold and at least one chunk per thread sharing them
    (``workers``), in chunks of equal size (no short last one)."""
    bc = sites or max(1, min(budget // max(1, per_site), -(-bsz // max(1, workers))))
    bc = max(1, min(bsz, bc))
    return -(-bsz // -(-bsz // bc))


def vote_shift(xs: Tensor, wc: Tensor, a_in: Tensor, m: int) -> Tensor:
    """The activation-weighted mean vote ``s[B, d, m] = sum_J a V / (sum_J a + 1e-12)``, one
    matrix product over all children at once; no gradient (a constant for the moments).

    ``xs[B, J, a, x]`` child poses, ``wc[J, x, c*m]``, ``a_in[B, J]``, ``m`` parent types.
    """
    bsz, j, a, xd = xs.shape
    cm = wc.shape[2]
    with torch.no_grad():
        # a x, written straight into the product's layout (one pass, no permuted copy)
        xa = xs.new_empty(bsz, a, j, xd, dtype=torch.result_type(xs, a_in))  # [B, a, J, x]
        torch.mul(xs.permute(0, 2, 1, 3), a_in[:, None, :, None], out=xa)  # [B, a, J, x]
        s = xa.view(bsz * a, j * xd) @ wc.reshape(j * xd, cm)  # [B*a, c*m]
        s = s / (a_in.sum(1) + 1e-12).repeat_interleave(a).unsqueeze(1)  # [B*a, c*m]
        return s.view(bsz, -1, m)  # [B, d, m]


class _Votes:
    """The chunks of sites of one pass, shared by ``site_workers`` threads
    (capsctl/layers/backend/chunks.py); each thread has its chunk buffers ``U[2, J, Bc, d, m]``
    (shifted votes, their squares) and a scratch of the same size, reused by its chunks."""

    def __init__(self, x: Tensor, wc: Tensor, shift: Tensor, sites: int = 0) -> None:
        j, bsz, a, _ = x.shape
        self.x, self.wc, self.shift = x, wc, shift  # [J, B, a, x], [J, x, c*m], [B, d, m]
        self.j, self.a = j, a
        self.d, self.m = shift.shape[1], shift.shape[2]
        per_site = j * self.d * self.m * x.element_size()
        workers = site_workers(x)
        budget = vote_chunk_bytes(x, EM_CHUNK_BYTES)
        self.bc = _chunk_sites(bsz, per_site, budget, workers, sites)
        self.spans = site_spans(bsz, self.bc, workers)

    def run(self, body: Callable[[int, tuple[Tensor, Tensor], int, int], None]) -> None:
        """``body(thread, buffers, b0, b1)`` for every chunk of sites ``b0:b1``."""
        n = 2 * self.j * self.bc * self.d * self.m

        def part(i: int, lo: int, hi: int) -> None:
            bufs = (self.x.new_empty(n), self.x.new_empty(n))
            for b0 in range(lo, hi, self.bc):
                body(i, bufs, b0, min(hi, b0 + self.bc))

        run_spans(part, self.spans)

    def build(self, bufs: tuple[Tensor, Tensor], b0: int, b1: int) -> Tensor:
        """``U[2, J, Bc, d, m]`` of sites ``b0:b1``: ``V - s`` and ``(V - s)^2``."""
        j, bc, a, d, m = self.j, b1 - b0, self.a, self.d, self.m
        u = bufs[0][: 2 * j * bc * d * m].view(2, j, bc, d, m)  # [2, J, Bc, d, m]
        xc = self.x[:, b0:b1].reshape(j, bc * a, -1)  # [J, Bc*a, x]
        torch.bmm(xc, self.wc, out=u[0].view(j, bc * a, -1))  # [J, Bc*a, c*m]
        u[0].sub_(self.shift[b0:b1])  # [J, Bc, d, m]
        torch.mul(u[0], u[0], out=u[1])  # [J, Bc, d, m]
        return u

    def moments(self, bufs: tuple[Tensor, Tensor], u: Tensor, r: Tensor) -> Tensor:
        """``sum_J r U``: ``u[2, J, Bc, d, m]``, ``r[J, Bc, m]`` -> ``[2, Bc, d, m]``."""
        t = bufs[1][: u.numel()].view_as(u)  # [2, J, Bc, d, m]
        torch.mul(u, r.unsqueeze(2), out=t)  # [2, J, Bc, d, m]
        return t.sum(1)  # [2, Bc, d, m]

    def quad(self, bufs: tuple[Tensor, Tensor], u: Tensor, qp: Tensor) -> Tensor:
        """``sum_{2, d} qp U``: ``u[2, J, Bc, d, m]``, ``qp[2, Bc, d, m]`` -> ``[J, Bc, m]``."""
        t = bufs[1][: u.numel()].view_as(u)  # [2, J, Bc, d, m]
        torch.mul(u, qp.unsqueeze(1), out=t)  # [2, J, Bc, d, m]
        return t[0].add_(t[1]).sum(2)  # [J, Bc, m]; faster than one sum over dims (0, 3)

    def backprop(self, dv: Tensor, b0: int, b1: int, gx: Tensor | None, gw: Tensor | None) -> None:
        """From ``dv[J, Bc, d, m]`` (d loss / d votes of sites ``b0:b1``): writes
        ``gx[J, B, a, x]`` at those sites and adds to ``gw[J, x, c*m]``."""
        j, bc, a = self.j, b1 - b0, self.a
        dvm = dv.view(j, bc * a, -1)  # [J, Bc*a, c*m]
        if gx is not None:
            gxc = torch.bmm(dvm, self.wc.transpose(1, 2))  # [J, Bc*a, x]
            gx[:, b0:b1].copy_(gxc.view(j, bc, a, -1))  # [J, Bc, a, x]
        if gw is not None:
            xct = self.x[:, b0:b1].reshape(j, bc * a, -1).transpose(1, 2)  # [J, x, Bc*a]
            gw.baddbmm_(xct, dvm)  # [J, x, c*m]


def _grad_buffers(votes: _Votes, needs: tuple[bool, ...]) -> tuple[Tensor | None, list[Tensor]]:
    """``gx[J, B, a, x]`` and one ``gw[J, x, c*m]`` per thread (summed by :func:`_sum_gw`)."""
    gx = torch.empty_like(votes.x) if needs[0] else None  # [J, B, a, x]
    gws = [torch.zeros_like(votes.wc) for _ in votes.spans] if needs[1] else []
    return gx, gws


def _sum_gw(gws: list[Tensor]) -> Tensor | None:
    for extra in gws[1:]:
        gws[0].add_(extra)
    return gws[0] if gws else None


def _weighted(r: Tensor, a: Tensor, b0: int, b1: int) -> Tensor:
    """``r a`` at sites ``b0:b1`` in the chunk layout: ``r[B, J, m]``, ``a[B, J]`` ->
    ``[J, Bc, m]`` (1/d of a vote chunk's size)."""
    return (r[b0:b1] * a[b0:b1].unsqueeze(-1)).transpose(0, 1).contiguous()  # [J, Bc, m]


def _grads(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
    """The tensor inputs' gradients, then None for each further input ``apply`` was given
    (the shift; the choice where one was passed)."""
    return (*grads, *[None] * (len(ctx.needs_input_grad) - len(grads)))


class VoteMoments(torch.autograd.Function):
    """``(r[B, J, m], a[B, J], x[J, B, a, x], wc[J, x, c*m], shift[B, d, m])`` ->
    ``S[2, B, d, m]``: ``sum_J r a (V - s)`` and ``sum_J r a (V - s)^2``, the M-step's moments
    with the assignments ``r`` weighted by the child activations ``a``, and their denominator,
    the mass ``[B, m, 1] = sum_J r a``. Saves no vote-sized tensor, and nothing of ``r``'s size
    but ``r`` itself: ``r a`` is formed chunk by chunk (pair by pair in the compiled loops), in
    the forward and again in the backward pass. The mass is one more sum of the same products
    (its gradient, ``a`` for ``r`` and ``sum_m r g`` for ``a``, joins the moments'); as a
    separate product, an expanded first assignment made the matrix product copy it site by
    site, and its gradient was another assignment-sized tensor to add."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        r: Tensor,
        a: Tensor,
        x: Tensor,
        wc: Tensor,
        shift: Tensor,
        choice: Choice | None = None,
    ) -> tuple:
        choice = choice or choose(r, a, x, wc, shift)  # asked once: the backward runs it too
        ctx.choice = choice
        if choice.backend == "native":
            r, a = r.contiguous(), a.contiguous()  # [B, J, m], [B, J]
            ctx.save_for_backward(r, a, x, wc, shift)
            out, mass = bindings.em_moments_forward(x, wc, shift, r, a)  # [2, B, d, m]
            return out, mass.unsqueeze(-1)  # [2, B, d, m], [B, m, 1]
        votes = _Votes(x, wc, shift, choice.sites)
        out = x.new_empty(2, x.shape[1], votes.d, votes.m)  # [2, B, d, m]

        def chunk(_: int, bufs: tuple[Tensor, Tensor], b0: int, b1: int) -> None:
            u = votes.build(bufs, b0, b1)  # [2, J, Bc, d, m]
            out[:, b0:b1] = votes.moments(bufs, u, _weighted(r, a, b0, b1))  # [2, Bc, d, m]

        votes.run(chunk)
        ctx.save_for_backward(r, a, x, wc, shift)
        mass = (r * a.unsqueeze(-1)).sum(1)  # [B, m]
        return out, mass.unsqueeze(-1)  # [2, B, d, m], [B, m, 1]

    @staticmethod
    @once_differentiable
    def backward(ctx, gs: Tensor, gm: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        r, a, x, wc, shift = ctx.saved_tensors
        gm = gm.squeeze(-1).contiguous()  # [B, m]
        choice = ctx.choice
        if choice.backend == "native":
            r, a, gs = r.contiguous(), a.contiguous(), gs.contiguous()
            needs = tuple(ctx.needs_input_grad[:4])
            gr, ga, gx, gw = bindings.em_moments_backward(x, wc, shift, r, a, gs, gm, needs)  # type: ignore[arg-type]
            return _grads(ctx, gr, ga, gx, gw)
        votes = _Votes(x, wc, shift, choice.sites)
        gr = r.new_empty(r.shape) if ctx.needs_input_grad[0] else None  # [B, J, m]
        ga = torch.empty_like(a) if ctx.needs_input_grad[1] else None  # [B, J]
        gx, gws = _grad_buffers(votes, ctx.needs_input_grad[2:4])
        gs = gs.contiguous()  # [2, B, d, m]

        def chunk(i: int, bufs: tuple[Tensor, Tensor], b0: int, b1: int) -> None:
            u = votes.build(bufs, b0, b1)  # [2, J, Bc, d, m]
            gsc = gs[:, b0:b1]  # [2, Bc, d, m]
            if gr is not None or ga is not None:
                gra = votes.quad(bufs, u, gsc).transpose(0, 1)  # [J, Bc, m] -> [Bc, J, m]
                gra = gra + gm[b0:b1].unsqueeze(1)  # [Bc, J, m]: and the mass's
                if gr is not None:
                    torch.mul(gra, a[b0:b1].unsqueeze(-1), out=gr[b0:b1])  # [Bc, J, m]
                if ga is not None:
                    ga[b0:b1] = (gra * r[b0:b1]).sum(-1)  # [Bc, J]
            if gx is None and not gws:
                return
            dv = torch.addcmul(gsc[0], u[0], gsc[1], value=2.0, out=u[1])  # [J, Bc, d, m]
            dv.mul_(_weighted(r, a, b0, b1).unsqueeze(2))  # [J, Bc, d, m]
            votes.backprop(dv, b0, b1, gx, gws[i] if gws else None)

        votes.run(chunk)
        return _grads(ctx, gr, ga, gx, _sum_gw(gws))


class VoteQuad(torch.autograd.Function):
    """``(qp[2, B, d, m], x[J, B, a, x], wc[J, x, c*m], shift[B, d, m])`` ->
    ``Q[B, J, m] = sum_d (q (V - s) + p (V - s)^2)``, in the assignments' layout (each chunk's
    ``[J, Bc, m]`` is written transposed). Saves no vote-sized tensor."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, qp: Tensor, x: Tensor, wc: Tensor, shift: Tensor, choice: Choice | None = None
    ) -> Tensor:
        qp = qp.contiguous()  # [2, B, d, m]
        choice = choice or choose(qp, x, wc, shift)  # asked once: the backward runs it too
        ctx.choice = choice
        if choice.backend == "native":
            ctx.save_for_backward(qp, x, wc, shift)
            return bindings.em_quad_forward(x, wc, shift, qp)  # [B, J, m]
        votes = _Votes(x, wc, shift, choice.sites)
        out = x.new_empty(x.shape[1], x.shape[0], votes.m)  # [B, J, m]

        def chunk(_: int, bufs: tuple[Tensor, Tensor], b0: int, b1: int) -> None:
            u = votes.build(bufs, b0, b1)  # [2, J, Bc, d, m]
            out[b0:b1] = votes.quad(bufs, u, qp[:, b0:b1]).transpose(0, 1)  # [Bc, J, m]

        votes.run(chunk)
        ctx.save_for_backward(qp, x, wc, shift)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, gq: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        qp, x, wc, shift = ctx.saved_tensors
        choice = ctx.choice
        if choice.backend == "native":
            needs = tuple(ctx.needs_input_grad[:3])
            gqp, gx, gw = bindings.em_quad_backward(x, wc, shift, qp, gq.contiguous(), needs)  # type: ignore[arg-type]
            return _grads(ctx, gqp, gx, gw)
        votes = _Votes(x, wc, shift, choice.sites)
        gqp = torch.empty_like(qp) if ctx.needs_input_grad[0] else None  # [2, B, d, m]
        gx, gws = _grad_buffers(votes, ctx.needs_input_grad[1:3])

        def chunk(i: int, bufs: tuple[Tensor, Tensor], b0: int, b1: int) -> None:
            u = votes.build(bufs, b0, b1)  # [2, J, Bc, d, m]
            gqc = gq[b0:b1].transpose(0, 1).contiguous()  # [Bc, J, m] -> [J, Bc, m]
            qpc = qp[:, b0:b1]  # [2, Bc, d, m]
            if gqp is not None:
                gqp[:, b0:b1] = votes.moments(bufs, u, gqc)  # [2, Bc, d, m]
            if gx is None and not gws:
                return
            dv = torch.addcmul(qpc[0], u[0], qpc[1], value=2.0, out=u[1])  # [J, Bc, d, m]
            dv.mul_(gqc.unsqueeze(2))  # [J, Bc, d, m]
            votes.backprop(dv, b0, b1, gx, gws[i] if gws else None)

        votes.run(chunk)
        return _grads(ctx, gqp, gx, _sum_gw(gws))


def pose_layout(t: Tensor, a: int, m: int) -> Tensor:
    """``[B, d, m]`` (``d = (a, c)``) -> ``[B, m, a, c]``, the Triton kernels' layout."""
    return t.view(t.shape[0], a, -1, m).permute(0, 3, 1, 2)  # [B, m, a, c]


def vote_moments(
    r: Tensor, a: Tensor, x: Tensor, wc: Tensor, shift: Tensor
) -> tuple[Tensor, Tensor]:
    """:class:`VoteMoments` (``S[2, B, d, m]`` and the mass ``[B, m, 1]``) on the backend
    capsctl/layers/backend/dispatch.py chooses: the fused Triton kernel on a GPU (the same
    sums in its layouts), else the chunked pass (compiled loops or torch code)."""
    choice = choose(r, a, x, wc, shift)
    if choice.backend == "triton":
        fused = run_fused("em_moments", _triton_moments, r, a, x, wc, shift)
        if fused is not None:
            return fused
        choice = Choice("chunked", "the Triton kernel failed at these shapes")
    return VoteMoments.apply(r, a, x, wc, shift, choice)


def _triton_moments(
    r: Tensor, a: Tensor, x: Tensor, wc: Tensor, shift: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`vote_moments` as the fused Triton kernel (its layouts in and out)."""
    from capsctl.layers.backend.triton.em_ops import triton_em_moments

    j, bsz, rows, xd = x.shape
    m = shift.shape[2]
    w = wc.view(j, xd, -1, m).transpose(2, 3)  # [J, x, c*m] -> [J, x, m, c]
    s1, s2, mass = triton_em_moments(r, a, x, w, pose_layout(shift, rows, m))  # [B, m, a, c] x2
    s = torch.stack((s1, s2)).permute(0, 1, 3, 4, 2)  # [2, B, a, c, m]
    return s.reshape(2, bsz, -1, m), mass.unsqueeze(-1)  # [2, B, d, m], [B, m, 1]


def vote_quad(qp: Tensor, x: Tensor, wc: Tensor, shift: Tensor) -> Tensor:
    """:class:`VoteQuad` (``Q[B, J, m]``) on the backend dispatch.py chooses (the fused Triton
    kernel on a GPU, else the chunked pass)."""
    choice = choose(qp, x, wc, shift)
    if choice.backend == "triton":
        fused = run_fused("em_quad", _triton_quad, qp, x, wc, shift)
        if fused is not None:
            return fused
        choice = Choice("chunked", "the Triton kernel failed at these shapes")
    return VoteQuad.apply(qp, x, wc, shift, choice)


def _triton_quad(qp: Tensor, x: Tensor, wc: Tensor, shift: Tensor) -> Tensor:
    """:func:`vote_quad` as the fused Triton kernel (its layouts in and out)."""
    from capsctl.layers.backend.triton.em_ops import triton_em_quad

    j, _, rows, xd = x.shape
    m = shift.shape[2]
    w = wc.view(j, xd, -1, m).transpose(2, 3)  # [J, x, c*m] -> [J, x, m, c]
    q, p = (pose_layout(t, rows, m) for t in qp.unbind(0))  # [B, m, a, c] each
    return triton_em_quad(q, p, x, w, pose_layout(shift, rows, m))  # [B, J, m]
