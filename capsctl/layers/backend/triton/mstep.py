"""Triton kernels of the parent-sized rest of EM routing's M-step (Hinton, Sabour, Frosst, ICLR
2018, Procedure 1): capsctl/layers/routers/em/procedure.py's ``_m_step``, forward and backward,
one kernel each.

From the moments about the shift ``s`` (``S[2, B, d, m]``: ``sum_J R a V'`` and
``sum_J R a V'^2`` with ``V' = V - s``), the mass ``M[B, m] = sum_J R a``, the shift
``s[B, d, m]`` (a constant) and the per-type ``beta_u[m]``, ``beta_a[m]``, per parent ``(b, j)``
with ``w = 1 / (M + eps)``::

    m1 = S1 w, m2 = S2 w, sw = M w, delta = m1 + s (sw - 1)           (mu = s + delta)
    var = m2 - 2 delta m1 + delta^2 sw + var_eps, lv = log var, iv = 1 / var
    cost = sum_h (beta_u + lv / 2) M, pre = lambda (beta_a - cost), act = sigmoid(pre)
    qp = (-2 delta iv, iv), c = logsigmoid(pre) - sum_h delta^2 iv / 2 - sum_h (lv + log 2 pi) / 2

- :func:`m_step_forward` (grid: site blocks x parent blocks): a program owns ``BB`` sites and
  ``MP`` of their parents (the M-step is independent across parents), ``[BB, DP, MP]`` tiles in
  the moments' layout ``(b, h, j)``; stores ``mu - s``'s sum with ``s`` (``mu`` as
  ``[B, d, m]``), ``act``, ``qp`` and ``c``.
- :func:`m_step_backward` (same grid): recomputes the above and takes the gradients of the four
  outputs back to ``S`` and ``M`` (stored) and to ``beta_u``, ``beta_a`` (each program's sum over
  its sites stored in its block's row of ``[site blocks, 2, m]``, which the caller sums). No
  atomics.

Sums in float32 (float64 for float64 inputs); padded pose entries and parents are masked out of
every sum.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["m_step_backward", "m_step_forward"]

LOG_2PI = tl.constexpr(1.8378770664093453)  # log(2 pi)


@triton.jit
def _tiles(B, M: tl.constexpr, D: tl.constexpr, I64: tl.constexpr, BB: tl.constexpr,
           DP: tl.constexpr, MP: tl.constexpr):  # fmt: skip
    """The program's ``[BB, DP, MP]`` offsets into ``[B, d, m]`` (sites ``BB`` from block
    ``program_id(0)``, parents ``MP`` from block ``program_id(1)``) and their mask, its
    ``[BB, MP]`` offsets into ``[B, m]`` and theirs, and the parent index ``[1, MP]``."""
    bb = tl.program_id(0) * BB + tl.arange(0, BB)
    if I64:
        bb = bb.to(tl.int64)
    jj = tl.program_id(1) * MP + tl.arange(0, MP)
    b3 = bb[:, None, None]
    h3 = tl.arange(0, DP)[None, :, None]
    j3 = jj[None, None, :]
    b2 = bb[:, None]
    j2 = jj[None, :]
    offs3 = (b3 * D + h3) * M + j3  # [BB, DP, MP]
    offs2 = b2 * M + j2  # [BB, MP]
    return offs3, (b3 < B) & (h3 < D) & (j3 < M), offs2, (b2 < B) & (j2 < M), j2


@triton.jit
def _log_sigmoid(x):
    """``log sigmoid(x)``, no overflow at any ``x``."""
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _moments(s_ptr, mass_ptr, sh_ptr, bu_ptr, offs3, mask3, offs2, mask2, j2, B, eps, veps,
             M: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The forward's intermediates of the program's parents (module docstring)."""
    s1 = tl.load(s_ptr + offs3, mask=mask3, other=0.0).to(ACC)  # [BB, DP, MP]
    s2 = tl.load(s_ptr + B * (D * M) + offs3, mask=mask3, other=0.0).to(ACC)
    sh = tl.load(sh_ptr + offs3, mask=mask3, other=0.0).to(ACC)
    mass = tl.load(mass_ptr + offs2, mask=mask2, other=0.0).to(ACC)[:, None, :]  # [BB, 1, MP]
    bu = tl.load(bu_ptr + j2, mask=j2 < M, other=0.0).to(ACC)[:, None, :]  # [1, 1, MP]
    inv = 1.0 / (mass + eps)
    m1 = s1 * inv
    sw = mass * inv
    delta = m1 + sh * (sw - 1.0)
    var = s2 * inv - 2.0 * delta * m1 + delta * delta * sw + veps
    var = tl.where(mask3, var, 1.0)  # padded entries: log 1 = 0, no log of 0
    lv = tl.log(var)
    iv = 1.0 / var
    cost_h = tl.where(mask3, bu + 0.5 * lv, 0.0)  # [BB, DP, MP]
    return s1, s2, sh, mass, inv, m1, sw, delta, lv, iv, cost_h


@triton.jit
def m_step_forward(
    s_ptr, mass_ptr, sh_ptr, bu_ptr, ba_ptr, mu_ptr, act_ptr, qp_ptr, c_ptr, B, lam, eps, veps,
    M: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr,
):  # fmt: skip
    """``mu[B, d, m]``, ``act[B, m]``, ``qp[2, B, d, m]`` and ``c[B, m]`` of the program's
    sites."""
    offs3, mask3, offs2, mask2, j2 = _tiles(B, M, D, I64, BB, DP, MP)
    _, _, sh, mass, _, _, _, delta, lv, iv, cost_h = _moments(
        s_ptr, mass_ptr, sh_ptr, bu_ptr, offs3, mask3, offs2, mask2, j2, B, eps, veps, M, D, ACC
    )
    ba = tl.load(ba_ptr + j2, mask=j2 < M, other=0.0).to(ACC)  # [1, MP]
    pre = lam * (ba - tl.sum(cost_h, axis=1) * tl.sum(mass, axis=1))  # [BB, MP]
    offset = tl.sum(tl.where(mask3, delta * delta * iv, 0.0), axis=1)  # [BB, MP]
    log_norm = 0.5 * tl.sum(tl.where(mask3, lv + LOG_2PI, 0.0), axis=1)  # [BB, MP]
    log_sig = _log_sigmoid(pre)
    tl.store(mu_ptr + offs3, sh + delta, mask=mask3)
    tl.store(qp_ptr + offs3, -2.0 * delta * iv, mask=mask3)
    tl.store(qp_ptr + B * (D * M) + offs3, iv, mask=mask3)
    tl.store(act_ptr + offs2, tl.exp(log_sig), mask=mask2)
    tl.store(c_ptr + offs2, log_sig - 0.5 * offset - log_norm, mask=mask2)


@triton.jit
def _given(ptrs, mask, PRESENT: tl.constexpr, ACC: tl.constexpr):
    """The gradient at ``ptrs`` where the output has one, else zeros (nothing read)."""
    if PRESENT:
        return tl.load(ptrs, mask=mask, other=0.0).to(ACC)
    return tl.zeros(mask.shape, ACC)


@triton.jit
def m_step_backward(
    s_ptr, mass_ptr, sh_ptr, bu_ptr, ba_ptr, gmu_ptr, gact_ptr, gqp_ptr, gc_ptr,
    gs_ptr, gmass_ptr, gb_ptr, B, lam, eps, veps,
    M: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr, I64: tl.constexpr,
    BB: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr, G_MU: tl.constexpr,
    G_ACT: tl.constexpr, G_QP: tl.constexpr, G_C: tl.constexpr,
):  # fmt: skip
    """From the gradients of ``mu``, ``act``, ``qp`` and ``c``: those of ``S`` (``gs_ptr``,
    ``[2, B, d, m]``) and ``M`` (``gmass_ptr``, ``[B, m]``), and the program's sums of those of
    ``beta_u``, ``beta_a`` (``gb_ptr``, its row of ``[programs, 2, m]``). ``G_MU``, ``G_ACT``,
    ``G_QP``, ``G_C``: whether that output has a gradient (an unused one is zero, not read)."""
    offs3, mask3, offs2, mask2, j2 = _tiles(B, M, D, I64, BB, DP, MP)
    s1, s2, sh, mass, inv, m1, sw, delta, lv, iv, cost_h = _moments(
        s_ptr, mass_ptr, sh_ptr, bu_ptr, offs3, mask3, offs2, mask2, j2, B, eps, veps, M, D, ACC
    )
    ba = tl.load(ba_ptr + j2, mask=j2 < M, other=0.0).to(ACC)  # [1, MP]
    mass2 = tl.sum(mass, axis=1)  # [BB, MP]
    sum_cost = tl.sum(cost_h, axis=1)  # [BB, MP]: sum_h (beta_u + lv / 2)
    pre = lam * (ba - sum_cost * mass2)
    sg = tl.exp(_log_sigmoid(pre))  # sigmoid(pre)
    g_act = _given(gact_ptr + offs2, mask2, G_ACT, ACC)  # [BB, MP]
    g_c = _given(gc_ptr + offs2, mask2, G_C, ACC)  # [BB, MP]
    g_mu = _given(gmu_ptr + offs3, mask3, G_MU, ACC)  # [BB, DP, MP]
    g_q0 = _given(gqp_ptr + offs3, mask3, G_QP, ACC)
    g_q1 = _given(gqp_ptr + B * (D * M) + offs3, mask3, G_QP, ACC)
    g_pre = g_act * sg * (1.0 - sg) + g_c * (1.0 - sg)  # [BB, MP]
    g_cost = -lam * g_pre  # [BB, MP]
    g_off = (-0.5 * g_c)[:, None, :]  # [BB, 1, MP]
    g_lv = -0.5 * g_c[:, None, :] + 0.5 * g_cost[:, None, :] * mass  # [BB, DP, MP]
    g_iv = g_q0 * (-2.0 * delta) + g_q1 + g_off * delta * delta
    g_var = g_lv * iv - g_iv * iv * iv
    g_delta = g_mu - 2.0 * g_q0 * iv + 2.0 * g_off * delta * iv
    g_delta += g_var * (2.0 * delta * sw - 2.0 * m1)
    g_m1 = g_delta - 2.0 * g_var * delta
    g_sw = tl.sum(tl.where(mask3, g_delta * sh + g_var * delta * delta, 0.0), axis=1)  # [BB, MP]
    g_inv = tl.sum(tl.where(mask3, g_m1 * s1 + g_var * s2, 0.0), axis=1) + g_sw * mass2
    inv2 = tl.sum(inv, axis=1)  # [BB, MP]: 1 / (M + eps)
    g_mass = g_cost * sum_cost + g_sw * inv2 - g_inv * inv2 * inv2
    tl.store(gs_ptr + offs3, g_m1 * inv, mask=mask3)
    tl.store(gs_ptr + B * (D * M) + offs3, g_var * inv, mask=mask3)
    tl.store(gmass_ptr + offs2, g_mass, mask=mask2)
    # beta_u: d cost / d beta_u = d M; beta_a: d pre / d beta_a = lambda
    g_bu = tl.sum(tl.where(mask2, g_cost * mass2 * D, 0.0), axis=0)  # [MP]
    g_ba = tl.sum(tl.where(mask2, lam * g_pre, 0.0), axis=0)  # [MP]
    jj = tl.program_id(1) * MP + tl.arange(0, MP)  # [MP]: the program's parents
    row = tl.program_id(0) * (2 * M) + jj
    tl.store(gb_ptr + row, g_bu, mask=jj < M)
    tl.store(gb_ptr + row + M, g_ba, mask=jj < M)
