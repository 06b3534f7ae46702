"""The vote-sized passes run by the compiled loops of capsctl/layers/native.py: thin bindings
that allocate the results, deal the parent sites to the threads of capsctl/layers/chunks.py (each
call of a loop handles a range of sites; ctypes releases the GIL) and add up the threads' weight
gradients in a fixed order. The callers (routing.py, weighted_pass.py, em_kernels.py) check
:func:`capsctl.layers.native.usable` first; layouts and letters as in those modules."""

from __future__ import annotations

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


def _gw_sum(gws: list[Tensor]) -> Tensor | None:
    """The threads' weight-gradient accumulators, added in a fixed order."""
    for extra in gws[1:]:
        gws[0].add_(extra)
    return gws[0] if gws else None


def routed_forward(x: Tensor, wc: Tensor, pq: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """``S[B, d, m]`` and ``R[J, B, m]`` of child poses ``x[J, B, a, x]``, weights
    ``wc[J, x, c*m]`` and ``pq[B, d, m]`` (``scale * P``, site-major), all contiguous."""
    lib = library()
    j, bsz, a, xd = x.shape
    m = pq.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    r = x.new_empty(j, bsz, m)  # [J, B, m]
    args = (_ptr(x), _ptr(wc), _ptr(pq), _ptr(s), _ptr(r), j, bsz, a, xd, c, m)

    def part(_: int, lo: int, hi: int) -> None:
        lib.capsctl_routed_forward(*args, lo, hi)

    run_spans(part, _spans(x))
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
    forward's ``R[J, B, m]``; each only when ``needs`` says so. One ``gw`` accumulator per
    thread, added in a fixed order."""
    lib = library()
    j, bsz, a, xd = x.shape
    m = pq.shape[2]
    spans = _spans(x)
    gx = torch.empty_like(x) if needs[0] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[1] else []  # [J, x, c*m] each
    gp = x.new_empty(bsz, a * c, m) if needs[2] else None  # [B, d, m]
    dims = (j, bsz, a, xd, c, m)

    def part(i: int, lo: int, hi: int) -> None:
        gw = gws[i] if gws else None
        ptrs = (x, wc, pq, r, gq, gx, gw, gp)
        lib.capsctl_routed_backward(*(_ptr(t) for t in ptrs), *dims, lo, hi)

    run_spans(part, spans)
    return gx, _gw_sum(gws), gp


def weighted_forward(x: Tensor, wc: Tensor, r: Tensor, c: int) -> Tensor:
    """``S[B, d, m] = sum_J R V`` of child poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``
    and given coefficients ``r[J, B, m]``, all contiguous (capsctl/layers/weighted_pass.py)."""
    lib = library()
    j, bsz, a, xd = x.shape
    m = r.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    args = (_ptr(x), _ptr(wc), _ptr(r), _ptr(s), j, bsz, a, xd, c, m)

    def part(_: int, lo: int, hi: int) -> None:
        lib.capsctl_weighted_forward(*args, lo, hi)

    run_spans(part, _spans(x))
    return s


def weighted_backward(
    x: Tensor, wc: Tensor, r: Tensor, gq: Tensor, c: int, needs: tuple[bool, bool, bool]
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``gx[J, B, a, x]``, ``gw[J, x, c*m]`` and ``gr[J, B, m]`` of the weighted
    pass from ``gq[B, d, m] = d loss / d S``; each only when ``needs`` says so."""
    lib = library()
    j, bsz, a, xd = x.shape
    m = r.shape[2]
    spans = _spans(x)
    gx = torch.empty_like(x) if needs[0] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[1] else []  # [J, x, c*m] each
    gr = torch.empty_like(r) if needs[2] else None  # [J, B, m]
    dims = (j, bsz, a, xd, c, m)

    def part(i: int, lo: int, hi: int) -> None:
        gw = gws[i] if gws else None
        ptrs = (x, wc, r, gq, gx, gw, gr)
        lib.capsctl_weighted_backward(*(_ptr(t) for t in ptrs), *dims, lo, hi)

    run_spans(part, spans)
    return gx, _gw_sum(gws), gr


def _run(name: str, x: Tensor, tensors: tuple[Tensor | None, ...], c: int, m: int) -> None:
    """``capsctl_<name>(*tensors, J, B, a, x, c, m, b0, b1)`` over the threads' sites."""
    fn = getattr(library(), f"capsctl_{name}")
    j, bsz, a, xd = x.shape
    ptrs = [_ptr(t) for t in tensors]

    def part(_: int, lo: int, hi: int) -> None:
        fn(*ptrs, j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, _spans(x))


def em_moments_forward(x: Tensor, wc: Tensor, shift: Tensor, r: Tensor, act: Tensor) -> Tensor:
    """EM's M-step moments ``S[2, B, d, m] = sum_J r a (u, u^2)``, ``u = V - shift``, of child
    poses ``x[J, B, a, x]``, weights ``wc[J, x, c*m]``, ``shift[B, d, m]``, assignments
    ``r[B, m, J]`` and activations ``act[B, J]``, all contiguous
    (:class:`capsctl.layers.em_kernels.VoteMoments`)."""
    m = r.shape[1]
    c = wc.shape[2] // m
    out = x.new_empty(2, x.shape[1], shift.shape[1], m)  # [2, B, d, m]
    _run("em_moments_forward", x, (x, wc, shift, r, act, out), c, m)
    return out


def em_moments_backward(
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    r: Tensor,
    act: Tensor,
    gs: Tensor,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of ``r[B, m, J]``, ``act[B, J]``, ``x`` and ``wc`` from ``gs[2, B, d, m]``;
    each only when ``needs`` says so."""
    m = r.shape[1]
    c = wc.shape[2] // m
    spans = _spans(x)
    gr = torch.empty_like(r) if needs[0] else None  # [B, m, J]
    ga = torch.empty_like(act) if needs[1] else None  # [B, J]
    gx = torch.empty_like(x) if needs[2] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[3] else []  # [J, x, c*m] each
    fn = library().capsctl_em_moments_backward
    j, bsz, a, xd = x.shape

    def part(i: int, lo: int, hi: int) -> None:
        ts = (x, wc, shift, r, act, gs, gr, ga, gx, gws[i] if gws else None)
        fn(*(_ptr(t) for t in ts), j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, spans)
    return gr, ga, gx, _gw_sum(gws)


def em_quad_forward(x: Tensor, wc: Tensor, shift: Tensor, qp: Tensor) -> Tensor:
    """EM's E-step quadratic form ``Q[B, m, J] = sum_d (q u + p u^2)`` with
    ``qp[2, B, d, m]`` (:class:`capsctl.layers.em_kernels.VoteQuad`), all contiguous."""
    m = qp.shape[3]
    c = wc.shape[2] // m
    out = x.new_empty(x.shape[1], m, x.shape[0])  # [B, m, J]
    _run("em_quad_forward", x, (x, wc, shift, qp, out), c, m)
    return out


def em_quad_backward(
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    qp: Tensor,
    gq: Tensor,
    needs: tuple[bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of ``qp``, ``x`` and ``wc`` from ``gq[B, m, J]``; each only when ``needs``
    says so."""
    m = qp.shape[3]
    c = wc.shape[2] // m
    spans = _spans(x)
    gqp = torch.empty_like(qp) if needs[0] else None  # [2, B, d, m]
    gx = torch.empty_like(x) if needs[1] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[2] else []  # [J, x, c*m] each
    fn = library().capsctl_em_quad_backward
    j, bsz, a, xd = x.shape

    def part(i: int, lo: int, hi: int) -> None:
        ts = (x, wc, shift, qp, gq, gqp, gx, gws[i] if gws else None)
        fn(*(_ptr(t) for t in ts), j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, spans)
    return gqp, gx, _gw_sum(gws)


def gated_forward(
    x: Tensor, wc: Tensor, lg: Tensor, act: Tensor, c: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Self-routing's pass: ``S[B, d, m] = sum_J c a V``, the total mass ``[B, m] = sum_J c a``
    and the coefficients ``c[J, B, m] = softmax_m(lg)`` of child poses ``x[J, B, a, x]``,
    weights ``wc[J, x, c*m]``, routing logits ``lg[J, B, m]`` and activations ``act[B, J]``,
    all contiguous."""
    j, bsz, a, _ = x.shape
    m = lg.shape[2]
    s = x.new_empty(bsz, a * c, m)  # [B, d, m]
    tot = x.new_empty(bsz, m)  # [B, m]
    cs = torch.empty_like(lg)  # [J, B, m]
    _run("gated_forward", x, (x, wc, lg, act, s, tot, cs), c, m)
    return s, tot, cs


def gated_backward(
    x: Tensor,
    wc: Tensor,
    cs: Tensor,
    act: Tensor,
    gs: Tensor,
    gt: Tensor,
    needs: tuple[bool, bool, bool, bool],
) -> tuple[Tensor | None, ...]:
    """Gradients of the logits ``[J, B, m]``, ``act[B, J]``, ``x`` and ``wc`` from
    ``gs[B, d, m]`` (of ``S``) and ``gt[B, m]`` (of the total mass); each only when ``needs``
    says so."""
    j, bsz, a, xd = x.shape
    m = cs.shape[2]
    c = wc.shape[2] // m
    spans = _spans(x)
    glg = torch.empty_like(cs) if needs[0] else None  # [J, B, m]
    gact = torch.empty_like(act) if needs[1] else None  # [B, J]
    gx = torch.empty_like(x) if needs[2] else None  # [J, B, a, x]
    gws = [torch.zeros_like(wc) for _ in spans] if needs[3] else []  # [J, x, c*m] each
    fn = library().capsctl_gated_backward

    def part(i: int, lo: int, hi: int) -> None:
        ts = (x, wc, cs, act, gs, gt, glg, gact, gx, gws[i] if gws else None)
        fn(*(_ptr(t) for t in ts), j, bsz, a, xd, c, m, lo, hi)

    run_spans(part, spans)
    return glg, gact, gx, _gw_sum(gws)
