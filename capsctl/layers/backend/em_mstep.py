"""The compiled library's EM M-step (capsctl/layers/backend/csrc/em_mstep.cpp): the
parent-sized rest of EM routing's M-step, forward and backward, as
capsctl/layers/routers/em/procedure.py calls it where
:func:`capsctl.layers.backend.dispatch.choose` says ``native``. Each function allocates its
results and deals the parent sites to the threads of capsctl/layers/backend/chunks.py, as
bindings.py does for the vote-sized passes; layouts as in em_mstep.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from capsctl.layers.backend.bindings import MIN_ROWS_PER_THREAD
from capsctl.layers.backend.chunks import run_spans, site_spans, site_workers
from capsctl.layers.backend.native import library

__all__ = ["em_mstep_backward", "em_mstep_forward"]


def _parent_spans(s: Tensor) -> list[tuple[int, int]]:
    """The sites of ``s[2, B, d, m]`` split between the threads, each with at least as many
    parent pose entries as :data:`MIN_ROWS_PER_THREAD` LayerNorm rows of 16 hold."""
    _, bsz, d, m = s.shape
    if bsz == 0:
        return []
    workers = max(1, min(site_workers(s), bsz * d * m // (MIN_ROWS_PER_THREAD * 16)))
    return site_spans(bsz, -(-bsz // workers), workers)


def em_mstep_forward(
    s: Tensor,
    mass: Tensor,
    shift: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    consts: Sequence[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """EM's M-step rest (csrc/em_mstep.cpp) of the moments ``s[2, B, d, m]``, the mass
    ``mass[B, m]``, the shift ``shift[B, d, m]`` and ``beta_u[m]``, ``beta_a[m]``; ``consts``:
    the inverse temperature, the mass's and the variances' epsilons. Returns ``mu[B, d, m]``,
    ``act[B, m]``, ``qp[2, B, d, m]`` and ``c[B, m]``; the sites dealt to the threads."""
    s, mass, shift, beta_u, beta_a = (t.contiguous() for t in (s, mass, shift, beta_u, beta_a))
    _, bsz, d, m = s.shape
    mu, qp = torch.empty_like(shift), torch.empty_like(s)
    act, c = s.new_empty(bsz, m), s.new_empty(bsz, m)
    fn = library().capsctl_em_mstep_forward
    ptrs = [t.data_ptr() for t in (s, mass, shift, beta_u, beta_a, mu, act, qp, c)]

    def part(_: int, b0: int, b1: int) -> None:
        fn(*ptrs, bsz, d, m, *consts, b0, b1)

    run_spans(part, _parent_spans(s))
    return mu, act, qp, c


def em_mstep_backward(
    s: Tensor,
    mass: Tensor,
    shift: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    consts: Sequence[float],
    grads: Sequence[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of :func:`em_mstep_forward`'s ``s``, ``mass``, ``beta_u`` and ``beta_a``
    from those of its four outputs (``grads``, each its output's shape); the betas' summed per
    thread in float64, the threads added in a fixed order."""
    ins = (s, mass, shift, beta_u, beta_a, *grads)
    s, mass, shift, beta_u, beta_a, g_mu, g_act, g_qp, g_c = (t.contiguous() for t in ins)
    _, bsz, d, m = s.shape
    g_s, g_mass = torch.empty_like(s), s.new_empty(bsz, m)
    spans = _parent_spans(s)
    accs = [s.new_zeros(2, m, dtype=torch.float64) for _ in spans]  # [g beta_u; g beta_a]
    fn = library().capsctl_em_mstep_backward
    ptrs = [t.data_ptr() for t in (s, mass, shift, beta_u, beta_a, g_mu, g_act, g_qp, g_c)]
    ptrs += [g_s.data_ptr(), g_mass.data_ptr()]

    def part(i: int, b0: int, b1: int) -> None:
        fn(*ptrs, accs[i].data_ptr(), bsz, d, m, *consts, b0, b1)

    run_spans(part, spans)
    acc = torch.stack(accs).sum(0).to(s.dtype) if accs else s.new_zeros(2, m)
    return g_s, g_mass, acc[0].clone(), acc[1].clone()
