"""The vote-sized passes run by the compiled loops of capsctl/layers/native.py: thin bindings
that allocate the results, deal the parent sites to the threads of capsctl/layers/chunks.py (each
call of a loop handles a range of sites; ctypes releases the GIL) and add up the threads' weight
gradients in a fixed order. The callers (routing.py, weighted_pass.py, em_kernels.py) check
:func:`capsctl.layers.native.usable` first; layouts and letters as in those modules."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from capsctl.layers.chunks import run_spans, site_spans, site_workers
from capsctl.layers.native import library

__all__ = [
    "em_moments_backward",
    "em_moments_forward",
    "em_quad_backward",
    "em_quad_forward",
    "gated_backward",
    "gated_forward",
    "routed_backward",
    "routed_forward",
    "split_gated_weights",
    "weighted_backward",
    "weighted_forward",
]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _spans(x: Tensor) -> list[tuple[int, int]]:
    """Sites split evenly between the threads of capsctl/layers/chunks.py."""
    bsz = x.shape[1]
    workers = site_workers(x)
    return site_spans(bsz, -(-bsz // workers), workers)


def _run(
    name: str,
    x: Tensor,
    tensors: tuple[Tensor | None, ...],
    c: int,
    m: int,
    per_thread: Sequence[Tensor | None] | None = None,
) -> None:
    """``capsctl_<name>(*tensors, [per_thread[i],] J, B, a, x, c, m, b0, b1)`` for the sites
    ``[b0, b1)`` of each thread ``i``."""
    fn = getattr(library(), f"capsctl_{name}")
    j, bsz, a, xd = x.shape
    ptrs = [_ptr(t) for t in tensors]

    def part(i: int, lo: int, hi: int) -> None:
        extra = () if per_thread is None else (_ptr(per_thread[i]),)
        fn(*ptrs, *extra, j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, _spans(x))


def _transposed(wc: Tensor, gx: Tensor | None) -> Tensor | None:
    """The weights ``wc[J, x, c*m]`` as ``[J, c*m, x]`` for a backward pass that computes
    ``gx`` (None otherwise): the loops of 16-d pose vectors multiply the votes' gradients by
    ``W^T`` a block of sites at a time, and transposing each child's weights there, once per
    block, took about a fifth of the pass. The loops of other shapes do not read it (a copy of
    the weights, small next to the pass)."""
    return None if gx is None else wc.transpose(1, 2).contiguous()


def _accumulator(x: Tensor, shape: Sequence[int]) -> Tensor:
    """An uninitialized weight-gradient accumulator (the loops zero it)."""
    return x.new_empty(shape)


def _run_backward(
    name: str,
    x: Tensor,
    tensors: tuple[Tensor | None, ...],
    c: int,
    m: int,
    shape: Sequence[int],
    need_w: bool,
) -> Tensor | None:
    """A backward pass (:func:`_run`) that gets one weight-gradient accumulator of ``shape``
    per thread as its last pointer (None where ``need_w`` is false), added up in a fixed order
    and returned. The loops zero their accumulator where they first touch it (a thread's first
    site, for every child), so it is allocated uninitialized: a separate fill cost 4-6 ms per
    9 MB accumulator, most of it the page faults of a fresh block."""
    n = len(_spans(x))
    gws = [_accumulator(x, shape) for _ in range(n)] if need_w else []  # e.g. [J, x, c*m] each
    _run(name, x, tensors, c, m, gws or [None] * n)
    for extra in gws[1:]:
        gws[0].add_(extra)
    return gws[0] if gws else None


def _if(need: bool, t: Tensor) -> Tensor | None:
    """``torch.empty_like(t)`` where a gradient is needed, else None."""
    return torch.empty_like(t) if need else None


def routed_forward(x: Tensor, wc: Tensor, pq: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """``S[B, d, m]`` and ``R[J, B, m]`` of child poses ``x[J, B, a, x]``, weights
    ``wc[J, x, c*m]`` and ``pq[B, d, m]`` (``scale * P``, site-major), all contiguous."""
    j, bsz, a, _ = x.shape
    m = pq.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    r = x.new_empty(j, bsz, m)  # [J, B, m]
    _run("routed_forward", x, (x, wc, pq, s, r), c, m)
    return s, r


def routed_backward(
    x: Tensor,
    wc: Tensor,
    pq: Tensor,
    r: Tensor,
    gq: Tensor,
    c: int,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``gx[J, B, a, x]``, ``gw[J, x, c*m]`` and ``gp[B, d, m]`` (without the
    agreement's scale) of the routed pass, from ``gq[B, d, m] = d loss / d S`` and the
    forward's ``R[J, B, m]``; each only when ``needs`` says so."""
    m = pq.shape[2]
    gx, gp = _if(needs[0], x), _if(needs[2], gq)  # [J, B, a, x], [B, d, m]
    ts = (x, wc, _transposed(wc, gx), pq, r, gq, gx, gp)
    gw = _run_backward("routed_backward", x, ts, c, m, wc.shape, needs[1])
    return gx, gw, gp


def weighted_forward(x: Tensor, wc: Tensor, r: Tensor, c: int) -> Tensor:
    """``S[B, d, m] = sum_J R V`` of child poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``
    and given coefficients ``r[J, B, m]``, all contiguous (capsctl/layers/weighted_pass.py)."""
    _, bsz, a, _ = x.shape
    m = r.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    _run("weighted_forward", x, (x, wc, r, s), c, m)
    return s


def weighted_backward(
    x: Tensor, wc: Tensor, r: Tensor, gq: Tensor, c: int, needs: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``gx[J, B, a, x]``, ``gw[J, x, c*m]`` and ``gr[J, B, m]`` of the weighted
    pass from ``gq[B, d, m] = d loss / d S``; each only when ``needs`` says so."""
    gx, gr = _if(needs[0], x), _if(needs[2], r)  # [J, B, a, x], [J, B, m]
    ts = (x, wc, _transposed(wc, gx), r, gq, gx, gr)
    gw = _run_backward("weighted_backward", x, ts, c, r.shape[2], wc.shape, needs[1])
    return gx, gw, gr


def em_moments_forward(
    x: Tensor, wc: Tensor, shift: Tensor, r: Tensor, act: Tensor
) -> tuple[Tensor, Tensor]:
    """EM's M-step moments ``S[2, B, d, m] = sum_J r a (u, u^2)``, ``u = V - shift``, and the
    mass ``[B, m] = sum_J r a`` of child poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``,
    ``shift[B, d, m]``, assignments ``r[B, J, m]`` and activations ``act[B, J]``, all
    contiguous (:class:`capsctl.layers.em_kernels.VoteMoments`)."""
    m = r.shape[2]
    out = x.new_empty(2, x.shape[1], shift.shape[1], m)  # [2, B, d, m]
    mass = x.new_empty(x.shape[1], m)  # [B, m]
    _run("em_moments_forward", x, (x, wc, shift, r, act, out, mass), wc.shape[2] // m, m)
    return out, mass


def em_moments_backward(
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    r: Tensor,
    act: Tensor,
    gs: Tensor,
    gm: Tensor,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of ``r[B, J, m]``, ``act[B, J]``, ``x`` and ``wc`` from ``gs[2, B, d, m]``
    and ``gm[B, m]`` (of the mass); each only when ``needs`` says so."""
    m = r.shape[2]
    gr, ga, gx = _if(needs[0], r), _if(needs[1], act), _if(needs[2], x)
    ts = (x, wc, _transposed(wc, gx), shift, r, act, gs, gm, gr, ga, gx)
    gw = _run_backward("em_moments_backward", x, ts, wc.shape[2] // m, m, wc.shape, needs[3])
    return gr, ga, gx, gw


def em_quad_forward(x: Tensor, wc: Tensor, shift: Tensor, qp: Tensor) -> Tensor:
    """EM's E-step quadratic form ``Q[B, J, m] = sum_d (q u + p u^2)`` with
    ``qp[2, B, d, m]`` (:class:`capsctl.layers.em_kernels.VoteQuad`), all contiguous."""
    m = qp.shape[3]
    out = x.new_empty(x.shape[1], x.shape[0], m)  # [B, J, m]
    _run("em_quad_forward", x, (x, wc, shift, qp, out), wc.shape[2] // m, m)
    return out


def em_quad_backward(
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    qp: Tensor,
    gq: Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of ``qp``, ``x`` and ``wc`` from ``gq[B, J, m]``; each only when ``needs``
    says so."""
    m = qp.shape[3]
    gqp, gx = _if(needs[0], qp), _if(needs[1], x)  # [2, B, d, m], [J, B, a, x]
    ts = (x, wc, _transposed(wc, gx), shift, qp, gq, gqp, gx)
    gw = _run_backward("em_quad_backward", x, ts, wc.shape[2] // m, m, wc.shape, needs[2])
    return gqp, gx, gw


def gated_forward(
    x: Tensor, wc: Tensor, wr: Tensor, br: Tensor, act: Tensor, c: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Self-routing's pass: ``S[B, d, m] = sum_J c a V``, the total mass ``[B, m] = sum_J c a``
    and the coefficients ``c[J, B, m] = softmax_m(X wr + br)`` of child poses ``x[J, B, a, x]``,
    weights ``wc[J, x, c*m]``, routing weights ``wr[J, a*x, m]`` and biases ``br[J, m]`` and
    activations ``act[B, J]``, all contiguous."""
    j, bsz, a, _ = x.shape
    m = wr.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    tot = x.new_empty(bsz, m)  # [B, m]
    cs = x.new_empty(j, bsz, m)  # [J, B, m]
    _run("gated_forward", x, (x, wc, wr, br, act, s, tot, cs), c, m)
    return s, tot, cs


def gated_backward(
    x: Tensor,
    wc: Tensor,
    wr: Tensor,
    cs: Tensor,
    act: Tensor,
    gs: Tensor,
    gt: Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of ``act[B, J]``, ``x`` and the weights (one flat tensor: ``wc``'s, ``wr``'s,
    then ``br[J, m]``'s, split by :func:`split_gated_weights`) from ``gs[B, d, m]`` (of ``S``)
    and ``gt[B, m]`` (of the total mass); each only when ``needs`` says so."""
    j, m = x.shape[0], cs.shape[2]
    gact, gx = _if(needs[0], act), _if(needs[1], x)
    ts = (x, wc, _transposed(wc, gx), wr, cs, act, gs, gt, gact, gx)
    size = wc.numel() + wr.numel() + j * m
    gacc = _run_backward("gated_backward", x, ts, wc.shape[2] // m, m, (size,), needs[2])
    return gact, gx, gacc


def split_gated_weights(gacc: Tensor, wc: Tensor, wr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`gated_backward`'s flat weight gradients -> ``gwc`` (like ``wc``), ``gwr`` (like
    ``wr``) and ``gbr[J, m]``."""
    gwc, gwr, gbr = gacc.split([wc.numel(), wr.numel(), wr.shape[0] * wr.shape[2]])
    return gwc.view(wc.shape), gwr.view(wr.shape), gbr.view(wr.shape[0], wr.shape[2])
