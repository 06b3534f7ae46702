"""The compiled library's functions (capsctl/layers/backend/csrc/), one Python function per
``extern "C"`` entry point: each allocates its results, deals the parent sites (or rows) to the
threads of capsctl/layers/backend/chunks.py (each call of a loop handles a range; ctypes
releases the GIL) and adds up the threads' weight gradients in a fixed order.

The passes of capsctl/layers/passes/ call these where :func:`capsctl.layers.backend.dispatch.choose`
says ``native``; layouts and letters as in those modules. ``capsctl_kernels_abi`` is read by
capsctl/layers/backend/native.py when it loads the library.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from capsctl.layers.backend.chunks import run_spans, site_spans, site_workers
from capsctl.layers.backend.native import library

__all__ = [
    "em_moments_backward",
    "em_moments_forward",
    "em_quad_backward",
    "em_quad_forward",
    "gated_backward",
    "gated_forward",
    "layer_norm_backward",
    "layer_norm_backward_layout",
    "layer_norm_forward",
    "layer_norm_forward_layout",
    "row_spans",
    "routed_backward",
    "routed_forward",
    "run_backward_pass",
    "run_pass",
    "split_gated_weights",
    "transposed",
    "weighted_backward",
    "weighted_forward",
]

# rows per thread's share below which one thread does all (splitting costs more than it saves)
MIN_ROWS_PER_THREAD = 4096


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _spans(x: Tensor) -> list[tuple[int, int]]:
    """Sites split evenly between the threads of capsctl/layers/backend/chunks.py."""
    bsz = x.shape[1]
    workers = site_workers(x)
    return site_spans(bsz, -(-bsz // workers), workers)


def run_pass(
    name: str,
    x: Tensor,
    tensors: tuple[Tensor | None, ...],
    c: int,
    m: int,
    per_thread: Sequence[Tensor | None] | None = None,
    dims: Sequence[int] = (),
) -> None:
    """``capsctl_<name>(*tensors, [per_thread[i],] J, B, a, x, c, m, *dims, b0, b1)`` for the
    sites ``[b0, b1)`` of each thread ``i``."""
    fn = getattr(library(), f"capsctl_{name}")
    j, bsz, a, xd = x.shape
    ptrs = [_ptr(t) for t in tensors]

    def part(i: int, lo: int, hi: int) -> None:
        extra = () if per_thread is None else (_ptr(per_thread[i]),)
        fn(*ptrs, *extra, j, bsz, a, xd, c, m, *dims, lo, hi)

    run_spans(part, _spans(x))


def transposed(wc: Tensor, gx: Tensor | None) -> Tensor | None:
    """The weights ``wc[J, x, c*m]`` as ``[J, c*m, x]`` for a backward pass that computes
    ``gx`` (None otherwise): the loops of 16-d pose vectors multiply the votes' gradients by
    ``W^T`` a block of sites at a time, and transposing each child's weights there, once per
    block, took about a fifth of the pass. The loops of other shapes do not read it (a copy of
    the weights, small next to the pass)."""
    return None if gx is None else wc.transpose(1, 2).contiguous()


def _accumulator(x: Tensor, shape: Sequence[int]) -> Tensor:
    """An uninitialized weight-gradient accumulator (the loops zero it)."""
    return x.new_empty(shape)


def run_backward_pass(
    name: str,
    x: Tensor,
    tensors: tuple[Tensor | None, ...],
    c: int,
    m: int,
    shape: Sequence[int],
    need_w: bool,
    dims: Sequence[int] = (),
) -> Tensor | None:
    """A backward pass (:func:`run_pass`) that gets one weight-gradient accumulator of ``shape``
    per thread as its last pointer (None where ``need_w`` is false), added up in a fixed order
    and returned. The loops zero their accumulator where they first touch it (a thread's first
    site, for every child), so it is allocated uninitialized: a separate fill cost 4-6 ms per
    9 MB accumulator, most of it the page faults of a fresh block."""
    n = len(_spans(x))
    gws = [_accumulator(x, shape) for _ in range(n)] if need_w else []  # e.g. [J, x, c*m] each
    run_pass(name, x, tensors, c, m, gws or [None] * n, dims)
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
    run_pass("routed_forward", x, (x, wc, pq, s, r), c, m)
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
    ts = (x, wc, transposed(wc, gx), pq, r, gq, gx, gp)
    gw = run_backward_pass("routed_backward", x, ts, c, m, wc.shape, needs[1])
    return gx, gw, gp


def weighted_forward(x: Tensor, wc: Tensor, r: Tensor, c: int) -> Tensor:
    """``S[B, d, m] = sum_J R V`` of child poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``
    and given coefficients ``r[J, B, m]``, all contiguous (capsctl/layers/passes/weighted.py)."""
    _, bsz, a, _ = x.shape
    m = r.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    run_pass("weighted_forward", x, (x, wc, r, s), c, m)
    return s


def weighted_backward(
    x: Tensor, wc: Tensor, r: Tensor, gq: Tensor, c: int, needs: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``gx[J, B, a, x]``, ``gw[J, x, c*m]`` and ``gr[J, B, m]`` of the weighted
    pass from ``gq[B, d, m] = d loss / d S``; each only when ``needs`` says so."""
    gx, gr = _if(needs[0], x), _if(needs[2], r)  # [J, B, a, x], [J, B, m]
    ts = (x, wc, transposed(wc, gx), r, gq, gx, gr)
    gw = run_backward_pass("weighted_backward", x, ts, c, r.shape[2], wc.shape, needs[1])
    return gx, gw, gr


def em_moments_forward(
    x: Tensor, wc: Tensor, shift: Tensor, r: Tensor, act: Tensor
) -> tuple[Tensor, Tensor]:
    """EM's M-step moments ``S[2, B, d, m] = sum_J r a (u, u^2)``, ``u = V - shift``, and the
    mass ``[B, m] = sum_J r a`` of child poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``,
    ``shift[B, d, m]``, assignments ``r[B, J, m]`` and activations ``act[B, J]``, all
    contiguous (:class:`capsctl.layers.passes.em_moments.VoteMoments`)."""
    m = r.shape[2]
    out = x.new_empty(2, x.shape[1], shift.shape[1], m)  # [2, B, d, m]
    mass = x.new_empty(x.shape[1], m)  # [B, m]
    run_pass("em_moments_forward", x, (x, wc, shift, r, act, out, mass), wc.shape[2] // m, m)
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
    ts = (x, wc, transposed(wc, gx), shift, r, act, gs, gm, gr, ga, gx)
    gw = run_backward_pass("em_moments_backward", x, ts, wc.shape[2] // m, m, wc.shape, needs[3])
    return gr, ga, gx, gw


def em_quad_forward(x: Tensor, wc: Tensor, shift: Tensor, qp: Tensor) -> Tensor:
    """EM's E-step quadratic form ``Q[B, J, m] = sum_d (q u + p u^2)`` with
    ``qp[2, B, d, m]`` (:class:`capsctl.layers.passes.em_moments.VoteQuad`), all contiguous."""
    m = qp.shape[3]
    out = x.new_empty(x.shape[1], x.shape[0], m)  # [B, J, m]
    run_pass("em_quad_forward", x, (x, wc, shift, qp, out), wc.shape[2] // m, m)
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
    ts = (x, wc, transposed(wc, gx), shift, qp, gq, gqp, gx)
    gw = run_backward_pass("em_quad_backward", x, ts, wc.shape[2] // m, m, wc.shape, needs[2])
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
    run_pass("gated_forward", x, (x, wc, wr, br, act, s, tot, cs), c, m)
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
    ts = (x, wc, transposed(wc, gx), wr, cs, act, gs, gt, gact, gx)
    size = wc.numel() + wr.numel() + j * m
    gacc = run_backward_pass("gated_backward", x, ts, wc.shape[2] // m, m, (size,), needs[2])
    return gact, gx, gacc


def split_gated_weights(gacc: Tensor, wc: Tensor, wr: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`gated_backward`'s flat weight gradients -> ``gwc`` (like ``wc``), ``gwr`` (like
    ``wr``) and ``gbr[J, m]``."""
    gwc, gwr, gbr = gacc.split([wc.numel(), wr.numel(), wr.shape[0] * wr.shape[2]])
    return gwc.view(wc.shape), gwr.view(wr.shape), gbr.view(wr.shape[0], wr.shape[2])


# -- the poses' LayerNorm (layer_norm.cpp) ------------------------------------------------------


def row_spans(rows: int, like: Tensor, block: int = 1) -> list[tuple[int, int]]:
    """One span of rows per thread, each a whole number of ``block`` rows."""
    workers = max(1, min(site_workers(like), rows // MIN_ROWS_PER_THREAD))
    per = -(-rows // workers)
    return site_spans(rows, -(-per // block) * block, workers)


def layer_norm_forward(
    x: Tensor, w: Tensor, b: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm of each row of ``x[R, d]`` (contiguous) with ``w[d]``, ``b[d]``: ``y[R, d]``,
    the rows' means and reciprocal standard deviations ``[R]``."""
    rows, d = x.shape
    w, b = w.contiguous(), b.contiguous()
    y, mean, rstd = torch.empty_like(x), x.new_empty(rows), x.new_empty(rows)
    fn = library().capsctl_layer_norm_forward
    ptrs = [t.data_ptr() for t in (x, w, b, y, mean, rstd)]

    def part(_: int, r0: int, r1: int) -> None:
        fn(*ptrs, d, eps, r0, r1)

    run_spans(part, row_spans(rows, x))
    return y, mean, rstd


def layer_norm_backward(
    x: Tensor, w: Tensor, mean: Tensor, rstd: Tensor, gy: Tensor, need_x: bool
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Gradients of :func:`layer_norm_forward`'s ``x`` (where ``need_x``), ``w`` and ``b`` from
    ``gy[R, d]``; the weights' summed per thread in float64, the threads added in a fixed
    order."""
    rows, d = x.shape
    gy = gy.contiguous()
    gx = torch.empty_like(x) if need_x else None
    spans = row_spans(rows, x)
    accs = [x.new_zeros(2, d, dtype=torch.float64) for _ in spans]  # [gw; gb] per thread
    fn = library().capsctl_layer_norm_backward
    ptrs = [t.data_ptr() for t in (x, w.contiguous(), mean, rstd, gy)]
    gx_ptr = None if gx is None else gx.data_ptr()

    def part(i: int, r0: int, r1: int) -> None:
        fn(*ptrs, gx_ptr, accs[i].data_ptr(), d, r0, r1)

    run_spans(part, spans)
    acc = torch.stack(accs).sum(0).to(x.dtype)  # [2, d], threads added in a fixed order
    return gx, acc[0], acc[1]


def layer_norm_forward_layout(
    x: Tensor,
    w: Tensor,
    b: Tensor,
    eps: float,
    out_shape: Sequence[int],
    layout: tuple[int, int, int],
    block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm of each 4x4 pose of ``x`` (standard or rows-first, contiguous) written in the
    other (or the same) layout, ``y`` of ``out_shape``; ``layout``: ``(sites, rows_in,
    rows_out)``; ``block``: capsules per block of the loops. Returns ``y``, the poses' means
    and reciprocal standard deviations."""
    count = x.numel() // 16
    y = x.new_empty(out_shape)
    mean, rstd = x.new_empty(count), x.new_empty(count)
    fn = library().capsctl_layer_norm_forward_layout
    ptrs = [t.data_ptr() for t in (x, w.contiguous(), b.contiguous(), y, mean, rstd)]

    def part(_: int, r0: int, r1: int) -> None:
        fn(*ptrs, *layout, eps, r0, r1)

    run_spans(part, row_spans(count, x, block))
    return y, mean, rstd


def layer_norm_backward_layout(
    x: Tensor,
    w: Tensor,
    mean: Tensor,
    rstd: Tensor,
    gy: Tensor,
    need_x: bool,
    layout: tuple[int, int, int],
    block: int,
) -> tuple[Tensor | None, Tensor, Tensor]:
    """Gradients of :func:`layer_norm_forward_layout`'s ``x`` (where ``need_x``; in ``x``'s
    layout), ``w`` and ``b`` from ``gy`` (in the output's layout)."""
    gy = gy.contiguous()
    gx = torch.empty_like(x) if need_x else None
    spans = row_spans(mean.numel(), x, block)
    accs = [x.new_zeros(2, 16, dtype=torch.float64) for _ in spans]  # [gw; gb]
    fn = library().capsctl_layer_norm_backward_layout
    ptrs = [t.data_ptr() for t in (x, w.contiguous(), mean, rstd, gy)]
    gx_ptr = None if gx is None else gx.data_ptr()

    def part(i: int, r0: int, r1: int) -> None:
        fn(*ptrs, gx_ptr, accs[i].data_ptr(), *layout, r0, r1)

    run_spans(part, spans)
    acc = torch.stack(accs).sum(0).to(x.dtype)  # [2, d], threads added in a fixed order
    return gx, acc[0], acc[1]
