"""EM routing's E-step fused into the next M-step's moments where the Triton kernels run (a
GPU): :func:`e_then_moments` and :func:`uniform_moments` (the first M-step's uniform
assignments) hand the routing of capsctl/layers/routers/em/procedure.py the moments
``S[2, B, d, m]`` and mass ``[B, m, 1]`` without storing the assignments
(:class:`~capsctl.layers.routers.em.windows.TritonEStepMoments`); where the kernels fail, the
unfused passes (:func:`e_step` of :func:`vote_quad`, then :func:`vote_moments`).
:func:`keeping_assignments` turns the fusion off, for a routing trace that records every
iteration's assignments.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from capsctl.layers.backend.dispatch import run_fused, takes_triton
from capsctl.layers.passes.em_moments import pose_layout, vote_moments, vote_quad
from capsctl.layers.routers.em.windows import WindowGrid, e_step, triton_e_then_moments

__all__ = ["e_then_moments", "fuses_e_steps", "keeping_assignments", "uniform_moments"]

# Whether the chunked routing returns every iteration's assignments (a routing trace asks for
# them): on a GPU the E-step is otherwise fused into the next M-step, which never stores them.
_KEEP_ASSIGNMENTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "em_keep_assignments", default=False
)


@contextmanager
def keeping_assignments(keep: bool = True) -> Iterator[None]:
    """Within the block, EM routing returns every iteration's assignments (in this thread or
    context only): :func:`uniform_moments` and :func:`e_then_moments` are not used."""
    token = _KEEP_ASSIGNMENTS.set(keep)
    try:
        yield
    finally:
        _KEEP_ASSIGNMENTS.reset(token)


def fuses_e_steps(x: Tensor, wc: Tensor) -> bool:
    """Whether EM routing over child poses ``x`` and weights ``wc`` fuses each E-step into the
    next moments: where the Triton kernels take them, unless the assignments are kept."""
    return not _KEEP_ASSIGNMENTS.get() and takes_triton(x, wc)


def e_then_moments(
    qp: Tensor,
    c: Tensor,
    a_in: Tensor,
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    grid: WindowGrid | None,
) -> tuple[Tensor, Tensor]:
    """An E-step from the last M-step's ``qp[2, B, d, m]`` and ``c[B, 1, m]``, then the moments
    of its assignments: ``S[2, B, d, m]`` and ``mass[B, m, 1]``, as :func:`vote_moments` of
    :func:`e_step` of :func:`vote_quad`. Fused Triton kernels where they run (the assignments
    never stored); those three where the kernels fail."""
    fused = run_fused(
        "em_estep_moments", functools.partial(_triton_e_then_moments, grid=grid),
        qp, c, a_in, x, wc, shift,
    )  # fmt: skip
    if fused is not None:
        return fused
    r = e_step(vote_quad(qp, x, wc, shift), c, grid)  # [B, J, m]
    return vote_moments(r, a_in, x, wc, shift)


def uniform_moments(
    r: Tensor, a_in: Tensor, x: Tensor, wc: Tensor, shift: Tensor, grid: WindowGrid | None
) -> tuple[Tensor, Tensor]:
    """:func:`vote_moments` of the first M-step's uniform assignments ``r[B, J, m]`` (an
    expanded ``1 / (m * windows)``) as the fused kernels of :func:`e_then_moments`: the
    E-step's operands zero and each child's normalizer ``lse = log(m * windows)`` given, so
    that no assignment-sized tensor is read or written. :func:`vote_moments` where they fail."""
    fused = run_fused(
        "em_estep_moments", functools.partial(_triton_uniform_moments, grid=grid),
        r, a_in, x, wc, shift,
    )  # fmt: skip
    if fused is not None:
        return fused
    return vote_moments(r, a_in, x, wc, shift)


def _triton_uniform_moments(
    r: Tensor,
    a_in: Tensor,
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    *,
    grid: WindowGrid | None,
) -> tuple[Tensor, Tensor]:
    bsz, m = a_in.shape[0], shift.shape[2]
    qp = shift.new_zeros(2, *shift.shape)  # [2, B, d, m]
    c = shift.new_zeros(bsz, 1, m)  # [B, 1, m]
    lse = -torch.log(r[:, :, 0])  # [B, J]: R = exp(0 - lse) = 1 / (m * windows)
    return _triton_e_then_moments(qp, c, a_in, x, wc, shift, grid=grid, lse=lse)


def _triton_e_then_moments(
    qp: Tensor,
    c: Tensor,
    a_in: Tensor,
    x: Tensor,
    wc: Tensor,
    shift: Tensor,
    *,
    grid: WindowGrid | None,
    lse: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`e_then_moments` as the Triton kernels (their layouts in and out); ``lse``: each
    child's normalizer, given (:func:`uniform_moments`) or from the E-step's statistics."""
    j, bsz, rows, xd = x.shape
    m = shift.shape[2]
    w = wc.view(j, xd, -1, m).transpose(2, 3)  # [J, x, c*m] -> [J, x, m, c]
    q, p = (pose_layout(t, rows, m) for t in qp.unbind(0))  # [B, m, a, c] each
    cb = c.reshape(bsz, m)  # [B, 1, m] -> [B, m]
    sh = pose_layout(shift, rows, m)  # [B, m, a, c]
    s, mass = triton_e_then_moments(q, p, cb, a_in, x, w, sh, grid, lse)  # [2, B, m, a, c]
    s = s.permute(0, 1, 3, 4, 2)  # [2, B, a, c, m]
    return s.reshape(2, bsz, -1, m), mass.unsqueeze(-1)  # [2, B, d, m], [B, m, 1]
