"""The compiled library's routing by agreement (capsctl/layers/backend/csrc/agreement.cpp):
every iteration of dynamic routing over a layer, forward and backward, as
capsctl/layers/passes/agreement.py calls it where
:func:`capsctl.layers.backend.dispatch.choose` says ``native``. The sites are dealt to the
threads of capsctl/layers/backend/chunks.py as for the other vote-sized passes (bindings.py);
layouts as in agreement.cpp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from capsctl.layers.backend.bindings import run_backward_pass, run_pass, transposed

__all__ = ["VOTE_BUDGET", "agreement_backward", "agreement_forward", "agreement_plan"]

#: Floats of votes a block of sites keeps (3 MiB): past the second-level cache, within the
#: last. Read back from there, they cost about as much as building them again, so a block keeps
#: them only where it holds enough sites for the weights' gradient (read and written once per
#: block) to stay a small part of the pass: at 16 sites (J=144 children of 16-d votes to 16
#: parents, one thread: forward 131 ms and backward 292 ms, against 154 and 353 ms for the two
#: routed passes before the uniform one), not at 8 (J=288 to 32 parents: 460 and 990 ms,
#: against 378 and 782). Elsewhere a block of 64 sites builds each child's votes again for
#: each use: three products forward, four backward (the routed passes: three and eight).
VOTE_BUDGET = 3 << 18
#: The fewest sites a block keeping its votes holds, and the most any block holds (VoteGrads'
#: block of 16-d votes).
MIN_BLOCK, MAX_BLOCK = 16, 64


def agreement_plan(j: int, d: int, m: int) -> tuple[int, bool]:
    """Sites a block of the one-pass routing holds for ``J`` children of ``d x m`` votes each,
    and whether it keeps their votes: a multiple of 8 within :data:`VOTE_BUDGET` (at most
    :data:`MAX_BLOCK`) where at least :data:`MIN_BLOCK` fit, else :data:`MAX_BLOCK` sites that
    build their votes again for each use."""
    fit = VOTE_BUDGET // max(1, j * d * m) // 8 * 8
    return (min(fit, MAX_BLOCK), True) if fit >= MIN_BLOCK else (MAX_BLOCK, False)


def agreement_forward(
    x: Tensor, wc: Tensor, c: int, iterations: int, plan: tuple[int, bool]
) -> tuple[Tensor, ...]:
    """The sums ``s[T, B, d, m]``, their squashes ``v[T, B, d, m]`` and the coefficients of
    iterations 2..T ``r[T-1, J, B, m]`` of child poses ``x[J, B, a, x]`` and weights
    ``wc[J, x, c*m]``, both contiguous, in blocks of sites as ``plan`` says
    (:func:`agreement_plan`)."""
    j, bsz, a, _ = x.shape
    m = wc.shape[2] // c
    s = x.new_empty(iterations, bsz, a * c, m)  # [T, B, d, m]
    if not plan[1]:  # the uniform pass's sums: one product, [B*a, J*x] @ [J*x, c*m]
        xs = x.permute(1, 2, 0, 3).reshape(bsz * a, -1)  # [B*a, J*x]
        torch.mm(xs, wc.view(-1, c * m), out=s[0].view(bsz * a, c * m))  # [B, a, c, m]
        s[0].mul_(1.0 / m)
    v = s.new_empty(s.shape)  # [T, B, d, m]
    r = x.new_empty(iterations - 1, j, bsz, m)  # [T-1, J, B, m]
    dims = (iterations, plan[0], int(plan[1]))
    run_pass("agreement_forward", x, (x, wc, s, v, r), c, m, dims=dims)
    return s, v, r


def agreement_backward(
    x: Tensor,
    wc: Tensor,
    s: Tensor,
    r: Tensor,
    gv: Tensor,
    c: int,
    plan: tuple[int, bool],
    needs: tuple[bool, bool],
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients ``gx[J, B, a, x]`` and ``gw[J, x, c*m]`` (each only where ``needs`` says) from
    ``gv[T, B, d, m]`` = d loss / d v of every iteration and the forward's ``s`` and ``r``."""
    m, iterations = wc.shape[2] // c, s.shape[0]
    gx = x.new_empty(x.shape) if needs[0] else None  # [J, B, a, x]
    ts = (x, wc, transposed(wc, gx), s, r, gv, gx)
    dims = (iterations, plan[0], int(plan[1]))
    gw = run_backward_pass(
        "agreement_backward", x, ts, c, m, wc.shape, needs[1], dims=dims
    )  # [J, x, c*m]
    return gx, gw
