"""EM routing (Hinton, Sabour, Frosst, "Matrix capsules with EM routing", ICLR 2018): the
routing procedure, over the votes (:func:`em_routing`) and without keeping them
(:func:`em_routing_chunked`, whose vote-sized work is capsctl/layers/passes/em_moments.py).

Letters and the site layout (parent sites in ``B``, the children that vote at a site in ``J``,
votes ``[B, m, J, d]``) as in capsctl/layers/passes/routed.py and
capsctl/layers/baseline_capsules.py.
Procedure 1 of the paper: a conv child's assignments are normalized over every parent it votes
for, as in the paper; the constants the paper leaves open (temperature schedule, epsilons,
weight init) come from the authors' published implementation (google-research/google-research,
``capsule_em/em_layers.py``; see the ``EM_*`` constants). Stabilizers the paper lacks (cost
standardization, routing conv windows separately) are knobs, off by default.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from capsctl.layers.backend import em_mstep
from capsctl.layers.backend.dispatch import choose, run_fused, takes_triton
from capsctl.layers.passes.em_moments import vote_moments, vote_quad, vote_shift
from capsctl.layers.routers.em.fused import e_then_moments, fuses_e_steps, uniform_moments
from capsctl.layers.routers.em.windows import WindowGrid, e_step, softmax_over_parents

# Constants of EM routing that the paper (Hinton, Sabour, Frosst, ICLR 2018) leaves open, from
# the authors' published implementation (google-research/google-research, capsule_em/).
# Added to sum_i R_ij a_i before dividing by it (capsule_em/em_layers.py, conv routing: 1e-7;
# its FC routing uses 1e-5).
EM_EPS = 1e-7
# Added to every variance sigma^2 (capsule_em/em_layers.py, ``min_var``): keeps log sigma and
# 1 / sigma^2 finite when the votes of a parent agree exactly (e.g. a parent with one child).
EM_VAR_EPS = 5e-4
# lambda_inf of the inverse-temperature schedule lambda_t = lambda_inf * (1 - 0.95^(t+1)),
# t = 0..T-1 (capsule_em/em_layers.py). The reference implementation's ``final_beta`` = 0.01
# (capsule_em/experiment.py and README.md) multiplies a cost written with log sigma^2 where the
# paper has log sigma, so the same temperature in the paper's formula is 2 * 0.01.
EM_FINAL_LAMBDA = 0.02
EM_LAMBDA_DECAY = 0.95
# FC capsule layers use a quarter of lambda_inf (``final_beta / 4`` in connector_capsule_mat).
EM_FC_LAMBDA_FACTOR = 0.25
# Weight std before truncation at 2 std (TensorFlow's truncated normal), per layer kind:
# conv_capsule_mat (0.3) and connector_capsule_mat (0.01) in capsule_em/em_layers.py.
EM_INIT_STD = {"conv": 0.3, "fc": 0.01}
# Only for the optional cost standardization (``standardize_costs``, not in the paper).
EM_COST_EPS = 1e-6
EM_ASSIGNMENTS = ("parents", "window")


def em_inverse_temperature(final_lambda: float, t: int) -> float:
    """``lambda_t = final_lambda * (1 - 0.95^(t+1))`` for iteration ``t = 0, 1, ...``: the
    schedule of the authors' implementation (capsule_em/em_layers.py); the paper only says
    that lambda follows a fixed schedule."""
    return final_lambda * (1.0 - EM_LAMBDA_DECAY ** (t + 1))


def em_routing(
    votes: Tensor,
    a_in: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iterations: int,
    final_lambda: float = EM_FINAL_LAMBDA,
    *,
    grid: WindowGrid | None = None,
    standardize_costs: bool = False,
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """EM routing (Hinton, Sabour, Frosst, ICLR 2018, Procedure 1) over votes ``V[B, m, J, d]``.

    ``a_in[B, J]``: child activations; ``beta_u[m]``, ``beta_a[m]``: learned per parent type.
    Iteration ``t = 0..T-1`` runs an M-step with inverse temperature
    ``lambda_t = final_lambda * (1 - 0.95^(t+1))`` (:func:`em_inverse_temperature`) and, except
    after the last (whose result the paper's procedure never uses), an E-step:

    - M-step: ``r_ij = R_ij a_i``; ``mu_j^h = sum_i r_ij V_ij^h / (sum_i r_ij + EM_EPS)``;
      ``(sigma_j^h)^2 = sum_i r_ij (V_ij^h - mu_j^h)^2 / (sum_i r_ij + EM_EPS) + EM_VAR_EPS``;
      ``cost_j^h = (beta_u + log sigma_j^h) sum_i r_ij``;
      ``a_j = sigmoid(lambda_t (beta_a - sum_h cost_j^h))``.
    - E-step: ``p_ij = N(V_ij; mu_j, diag sigma_j^2)``; ``R_ij = a_j p_ij / sum_k a_k p_ik``,
      computed in log space as a softmax of ``log a_j + log p_ij`` (same value, no underflow).

    The sum over ``k`` runs over every parent child ``i`` votes for. With ``grid=None`` those
    are the ``m`` parents of its site (an FC layer, or a conv layer routed window by window);
    with the :class:`WindowGrid` of a conv layer it runs over all of them, in every window the
    child falls in, as the paper's conv layers do, and the first iteration's ``R_ij`` is
    uniform over them, ``1 / (m * windows of i)`` (the paper's ``1 / |Omega_{L+1}|`` over the
    parents the child is connected to; the authors' code starts from ``1/m`` in every window).

    ``standardize_costs`` (off by default; not in the paper nor the authors' code) replaces
    ``sum_h cost_j^h`` by ``(c_j - mean_k c_k) / (std_k c_k + EM_COST_EPS)`` over the ``m`` parent
    types of the site (population std, taken as ``sqrt(var + EM_COST_EPS^2)``). A stabilizer: the
    raw cost grows with the number of children and the vote scale, the standardized one is
    O(1), so O(1) temperatures work in every layer; pair it with ``final_lambda`` near 1.

    Returns ``mu[B, m, d]``, ``a_out[B, m]`` and per iteration the assignment ``R[B, m, J]``
    used by that M-step, the means and the activations after it.
    """
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    bsz, m, j, _ = votes.shape
    r = _first_assignment(votes, bsz, m, j, grid)  # [B, m, J]
    a_w = a_in.unsqueeze(1)  # [B, 1, J]
    rs: list[Tensor] = []
    mus: list[Tensor] = []
    acts: list[Tensor] = []
    mu = votes.new_zeros(bsz, m, votes.shape[-1])
    a_out = votes.new_zeros(bsz, m)
    for t in range(iterations):
        rs.append(r)
        # M-step
        ra = r * a_w  # [B, m, J]
        mass = ra.sum(-1, keepdim=True)  # [B, m, 1]
        wts = ra / (mass + EM_EPS)  # [B, m, J]
        mu = (wts.unsqueeze(2) @ votes).squeeze(2)  # [B, m, 1, J] @ [B, m, J, d] -> [B, m, d]
        diff = votes - mu.unsqueeze(2)  # [B, m, J, d]
        diff2 = diff * diff  # [B, m, J, d]
        var = (wts.unsqueeze(2) @ diff2).squeeze(2) + EM_VAR_EPS  # [B, m, d]
        log_var = torch.log(var)  # [B, m, d]; log sigma = log_var / 2
        pre = _pre_activation(mass, log_var, beta_u, beta_a, final_lambda, t, standardize_costs)
        a_out = torch.sigmoid(pre)  # [B, m]
        mus.append(mu)
        acts.append(a_out)
        if t + 1 < iterations:
            # E-step: sum_h (V - mu)^2 / sigma^2
            maha = (diff2 @ (1.0 / var).unsqueeze(-1)).squeeze(-1)  # [B, m, J, d] @ [B, m, d, 1]
            r = _e_step(maha, log_var, pre, grid)  # [B, m, J]
    return mu, a_out, rs, mus, acts


def _first_assignment(like: Tensor, bsz: int, m: int, j: int, grid: WindowGrid | None) -> Tensor:
    """``R[B, m, J]`` of the first M-step: uniform over the parents each child votes for."""
    if grid is None:
        return like.new_full((bsz, m, 1), 1.0 / m).expand(bsz, m, j)  # [B, m, J]
    windows = grid.sum_overwindow_sites(like.new_ones(bsz, j))  # [B, J]
    return (1.0 / (m * windows)).unsqueeze(1).expand(bsz, m, j)  # [B, m, J]


def _pre_activation(
    mass: Tensor,
    log_var: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    final_lambda: float,
    t: int,
    standardize_costs: bool,
) -> Tensor:
    """``lambda_t (beta_a - sum_h cost^h)`` with ``cost^h = (beta_u + log sigma^h) mass``:
    ``mass[B, m, 1]``, ``log_var[B, m, d]`` -> ``[B, m]`` (costs standardized over the ``m``
    parent types if asked)."""
    m = log_var.shape[1]
    cost = ((beta_u.view(1, m, 1) + 0.5 * log_var) * mass).sum(-1)  # [B, m]
    if standardize_costs:
        mean = cost.mean(-1, keepdim=True)  # [B, 1]
        std = torch.sqrt((cost - mean).pow(2).mean(-1, keepdim=True) + EM_COST_EPS**2)
        cost = (cost - mean) / (std + EM_COST_EPS)  # [B, m]
    return em_inverse_temperature(final_lambda, t) * (beta_a.view(1, m) - cost)  # [B, m]


def _e_step(maha: Tensor, log_var: Tensor, pre: Tensor, grid: WindowGrid | None) -> Tensor:
    """The next ``R[B, m, J]`` from ``maha[B, m, J] = sum_h (V - mu)^2 / sigma^2``:
    ``log p = -maha / 2 - sum_h log(2 pi sigma^2) / 2``; a softmax of ``log a + log p`` over
    every parent the child votes for (those of its site when ``grid`` is None)."""
    log_norm = 0.5 * (log_var + math.log(2.0 * math.pi)).sum(-1, keepdim=True)  # [B, m, 1]
    log_ap = F.logsigmoid(pre).unsqueeze(-1) - 0.5 * maha - log_norm  # [B, m, J]
    if grid is None:
        return torch.softmax(log_ap, dim=1)  # [B, m, J]
    return softmax_over_parents(log_ap, grid)  # [B, m, J]


def em_routing_chunked(
    xs: Tensor,
    weight: Tensor,
    a_in: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iterations: int,
    final_lambda: float = EM_FINAL_LAMBDA,
    *,
    rows: int,
    grid: WindowGrid | None = None,
    standardize_costs: bool = False,
) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor], list[Tensor]]:
    """:func:`em_routing` of the votes ``V_ij = X_i W_ij`` without building them whole.

    ``xs[B, J, a*x]`` child poses (``a = rows``), ``weight[J, x, m, c]`` (any leading dims that
    flatten to ``J``). Same math and results; the votes are built chunk by chunk of parent sites
    and built again in the backward pass (:mod:`capsctl.layers.passes.em_moments`), so no vote-sized
    tensor is kept. The moments are taken about the activation-weighted mean vote ``s``
    (:func:`vote_shift`): with ``V' = V - s`` and ``w = r / (mass + EM_EPS)``,
    ``mu - s = delta = sum w V' + s (sum w - 1)``,
    ``sigma^2 = sum w V'^2 - 2 delta sum w V' + delta^2 sum w + EM_VAR_EPS`` and
    ``sum_h (V - mu)^2 / sigma^2 = sum_h (V'^2 - 2 delta V' + delta^2) / sigma^2``.

    Where the Triton kernels run (a GPU), each E-step is fused into the next M-step's moments
    and the assignments of iterations after the first are never stored: ``rs`` then holds the
    first iteration's only, unless :func:`~capsctl.layers.routers.em.fused.keeping_assignments`
    asks for all of them (capsctl/layers/routers/em/fused.py).
    """
    if iterations < 1:
        raise ValueError("iterations must be >= 1")
    bsz, j = a_in.shape
    xd, m, c = weight.shape[-3:]
    x = xs.view(bsz, j, rows, xd).permute(1, 0, 2, 3).contiguous()  # [J, B, a, x]
    wc = weight.reshape(j, xd, m, c).transpose(2, 3).reshape(j, xd, c * m)  # [J, x, c*m]
    shift = vote_shift(xs.view(bsz, j, rows, xd), wc, a_in, m)  # [B, d, m]
    # the assignments site-, child-, then parent-major (capsctl/layers/passes/em_moments.py)
    r = _first_assignment(xs, bsz, m, j, grid).transpose(1, 2)  # [B, J, m]
    fuse = fuses_e_steps(x, wc)
    e_operands: tuple[Tensor, Tensor] | None = None  # the last M-step's qp and c, when fused
    rs: list[Tensor] = []
    mus: list[Tensor] = []
    acts: list[Tensor] = []
    for t in range(iterations):
        # [2, B, d, m] and [B, m, 1]: sum_J R a (V', V'^2) and sum_J R a, R a formed chunk by chunk
        if e_operands is None:
            rs.append(r.transpose(1, 2))  # [B, m, J]
            if fuse:  # the uniform assignments, never stored either
                s, mass = uniform_moments(r, a_in, x, wc, shift, grid)
            else:
                s, mass = vote_moments(r, a_in, x, wc, shift)
        else:
            s, mass = e_then_moments(*e_operands, a_in, x, wc, shift, grid)
        mu, act, qp, c = _parent_step(
            s, mass, shift, beta_u, beta_a, final_lambda, t, standardize_costs
        )
        mus.append(mu)
        acts.append(act)
        if t + 1 < iterations:
            if fuse:
                e_operands = (qp, c.transpose(1, 2))
            else:
                r = e_step(vote_quad(qp, x, wc, shift), c.transpose(1, 2), grid)  # [B, J, m]
    return mus[-1], acts[-1], rs, mus, acts


def _parent_step(
    s: Tensor,
    mass: Tensor,
    shift: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    final_lambda: float,
    t: int,
    standardize: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_m_step` of iteration ``t`` from the moments ``s[2, B, d, m]`` and ``mass[B, m,
    1]`` about ``shift[B, d, m]``: one Triton kernel each way where they run (a GPU), the
    compiled loops where capsctl/layers/backend/dispatch.py says ``native``, else torch code
    whose intermediates are recomputed in the backward pass (a checkpoint). Cost
    standardization is torch code everywhere."""
    if not standardize:
        lam = em_inverse_temperature(final_lambda, t)
        if takes_triton(s, mass):
            fused = functools.partial(_triton_m_step, lam=lam)
            outs = run_fused("m_step", fused, s, mass, shift, beta_u, beta_a)
            if outs is not None:
                return outs
        elif choose(s, mass).backend == "native":
            mu_t, act, qp, c = _NativeMStep.apply(s, mass, shift, beta_u, beta_a, lam)
            return mu_t.transpose(1, 2), act, qp, c  # mu [B, m, d]
    step = functools.partial(_m_step, final_lambda=final_lambda, t=t, standardize=standardize)
    ins = (s, mass, shift.transpose(1, 2), beta_u, beta_a)  # the shift as [B, m, d]
    if torch.is_grad_enabled():  # keep the inputs, recompute the parent-sized rest
        return checkpoint(step, *ins, use_reentrant=False, preserve_rng_state=False)
    return step(*ins)


class _NativeMStep(torch.autograd.Function):
    """:func:`_m_step` without cost standardization as the compiled loops
    (capsctl/layers/backend/csrc/em_mstep.cpp): ``(s[2, B, d, m], mass[B, m, 1], shift[B, d, m],
    beta_u[m], beta_a[m], lambda)`` -> ``mu[B, d, m]`` (the caller transposes it),
    ``act[B, m]``, ``qp[2, B, d, m]``, ``c[B, m, 1]``; one pass over the parents each way
    (the backward recomputes the forward's intermediates), saving only the inputs."""

    @staticmethod
    def forward(ctx, s, mass, shift, beta_u, beta_a, lam):  # type: ignore[no-untyped-def, override]
        consts = (float(lam), EM_EPS, EM_VAR_EPS)
        mu, act, qp, c = em_mstep.em_mstep_forward(s, mass[..., 0], shift, beta_u, beta_a, consts)
        ctx.save_for_backward(s, mass, shift, beta_u, beta_a)
        ctx.consts = consts
        return mu, act, qp, c.unsqueeze(-1)

    @staticmethod
    @once_differentiable
    def backward(ctx, g_mu, g_act, g_qp, g_c):  # type: ignore[no-untyped-def, override]
        s, mass, shift, beta_u, beta_a = ctx.saved_tensors
        g_s, g_mass, g_bu, g_ba = em_mstep.em_mstep_backward(
            s, mass[..., 0], shift, beta_u, beta_a, ctx.consts, (g_mu, g_act, g_qp, g_c[..., 0])
        )
        return g_s, g_mass.unsqueeze(-1), None, g_bu, g_ba, None


def _triton_m_step(
    s: Tensor, mass: Tensor, shift: Tensor, beta_u: Tensor, beta_a: Tensor, *, lam: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from capsctl.layers.backend.triton.mstep_ops import triton_m_step

    return triton_m_step(s, mass, shift, beta_u, beta_a, lam, EM_EPS, EM_VAR_EPS)


def _m_step(
    s: Tensor,
    mass: Tensor,
    s_bm: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    *,
    final_lambda: float,
    t: int,
    standardize: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The parent-sized rest of an M-step and the E-step's per-parent terms, from the moments
    about the shift ``s_bm[B, m, d]`` (``s[2, B, d, m]``, :class:`VoteMoments`) and
    ``mass[B, m, 1]``: the means ``mu[B, m, d]``, the activations ``[B, m]``, the operands
    ``qp[2, B, d, m]`` of :class:`VoteQuad` and ``c[B, m, 1]``, the part of ``log a_j +
    log p_ij`` that does not depend on the child (``log a_j``, the Gaussian's normalizer and the
    constant term ``sum_h delta^2 / sigma^2`` of the quadratic form; see
    :func:`em_routing_chunked` and :class:`~capsctl.layers.routers.em.windows.EStep`). Cheap next
    to the vote-sized passes, so the chunked routing recomputes it in the backward pass instead of
    keeping its dozen intermediates."""
    inv = 1.0 / (mass + EM_EPS)  # [B, m, 1]
    m1, m2 = s[0].transpose(1, 2) * inv, s[1].transpose(1, 2) * inv  # [B, m, d] each
    sw = mass * inv  # [B, m, 1]
    delta = m1 + s_bm * (sw - 1.0)  # [B, m, d]; mu - s
    var = m2 - 2.0 * delta * m1 + delta * delta * sw + EM_VAR_EPS  # [B, m, d]
    log_var = torch.log(var)  # [B, m, d]
    pre = _pre_activation(mass, log_var, beta_u, beta_a, final_lambda, t, standardize)  # [B, m]
    inv_var = 1.0 / var  # [B, m, d]
    qp = torch.stack((-2.0 * delta * inv_var, inv_var)).transpose(2, 3)  # [2, B, d, m]
    offset = (delta * delta * inv_var).sum(-1, keepdim=True)  # [B, m, 1]
    log_norm = 0.5 * (log_var + math.log(2.0 * math.pi)).sum(-1, keepdim=True)  # [B, m, 1]
    c = F.logsigmoid(pre).unsqueeze(-1) - 0.5 * offset - log_norm  # [B, m, 1]
    return s_bm + delta, torch.sigmoid(pre), qp, c
