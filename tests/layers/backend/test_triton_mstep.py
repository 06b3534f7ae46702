"""The rest of EM routing's M-step as Triton kernels (capsctl/layers/backend/triton/mstep.py),
run on the CPU by Triton's interpreter: from the moments of the votes about a shift, the
paper's M-step (Hinton, Sabour, Frosst, ICLR 2018, Procedure 1) and the per-parent terms of
the next E-step, against those equations written here over explicit votes; its gradients
against the torch code's and by gradcheck; EM layers run it as the kernels; a failing kernel
falls back; cost standardization stays torch code."""

from __future__ import annotations

import logging
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend.triton import mstep as mstep_kernels  # noqa: E402
from capsctl.layers.backend.triton import mstep_ops  # noqa: E402
from capsctl.layers.backend.triton.mstep_ops import triton_m_step  # noqa: E402
from capsctl.layers.routers.em import procedure  # noqa: E402

F64 = torch.float64
EPS = 1e-7  # added to sum_i R_ij a_i (the authors' conv routing)
VAR_EPS = 5e-4  # added to every variance (the authors' min_var)

# (B parent sites, J children, d pose entries, m parent types): 4x4 poses, a block edge, one
# entry, one parent, 6x6 poses whose parents take two programs (the second one partial)
SHAPES = {"matrix": (5, 6, 16, 3), "many-sites": (70, 3, 4, 10), "vector-1": (3, 4, 1, 2),
          "one-parent": (4, 5, 16, 1), "parent-blocks": (3, 4, 36, 21)}  # fmt: skip


def _case(shape: tuple[int, ...], dtype: torch.dtype = F64, seed: int = 0):
    """Votes ``V[B, J, m, d]``, assignments ``R[B, J, m]``, child activations ``a[B, J]``,
    a shift ``s[B, d, m]``, ``beta_u[m]``, ``beta_a[m]`` and the moments the kernels take."""
    bsz, j, d, m = shape
    g = torch.Generator().manual_seed(seed)
    votes = torch.randn(bsz, j, m, d, generator=g, dtype=dtype)
    r = torch.softmax(torch.randn(bsz, j, m, generator=g, dtype=dtype), -1)
    a = torch.rand(bsz, j, generator=g, dtype=dtype)
    shift = torch.randn(bsz, d, m, generator=g, dtype=dtype) * 0.3
    beta_u, beta_a = (
        torch.randn(m, generator=g, dtype=dtype),
        torch.randn(m, generator=g, dtype=dtype),
    )
    k = r * a[:, :, None]  # [B, J, m]: R a
    u = votes - shift.transpose(1, 2)[:, None]  # [B, J, m, d]: V - s
    s1 = torch.einsum("bjm,bjmd->bdm", k, u)
    s2 = torch.einsum("bjm,bjmd->bdm", k, u * u)
    moments = torch.stack((s1, s2))  # [2, B, d, m]
    mass = k.sum(1)[:, :, None]  # [B, m, 1]
    return votes, k, moments, mass, shift, beta_u, beta_a


@pytest.mark.parametrize("name", SHAPES)
def test_the_m_step_kernel_matches_the_papers_equations(name: str) -> None:
    votes, k, moments, mass, shift, beta_u, beta_a = _case(SHAPES[name])
    lam = 0.37
    mu, act, qp, c = triton_m_step(moments, mass, shift, beta_u, beta_a, lam, EPS, VAR_EPS)
    # the M-step: mu = sum R a V / (sum R a + eps), sigma^2 about mu likewise, plus var_eps
    w = k / (k.sum(1, keepdim=True) + EPS)  # [B, J, m]
    mu_want = torch.einsum("bjm,bjmd->bmd", w, votes)
    var = torch.einsum("bjm,bjmd->bmd", w, (votes - mu_want[:, None]) ** 2) + VAR_EPS
    cost = ((beta_u[None, :, None] + 0.5 * var.log()) * k.sum(1)[:, :, None]).sum(-1)
    act_want = torch.sigmoid(lam * (beta_a - cost))  # [B, m]
    torch.testing.assert_close(mu, mu_want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(act, act_want, rtol=1e-9, atol=1e-12)
    # the E-step's terms: c - sum_h (q U + p U^2) / 2 = log a_j + log N(V; mu, sigma^2)
    u = votes - shift.transpose(1, 2)[:, None]  # [B, J, m, d]
    q, p = qp[0].transpose(1, 2), qp[1].transpose(1, 2)  # [B, m, d] each
    quad = (q[:, None] * u + p[:, None] * u * u).sum(-1)  # [B, J, m]
    log_p = -0.5 * (((votes - mu_want[:, None]) ** 2 / var[:, None]).sum(-1))
    log_p = log_p - 0.5 * (var.log() + math.log(2 * math.pi)).sum(-1)[:, None]
    want = torch.log(act_want)[:, None] + log_p  # [B, J, m]
    torch.testing.assert_close(c.transpose(1, 2) - 0.5 * quad, want, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("name", ["matrix", "many-sites", "one-parent", "parent-blocks"])
def test_the_m_step_gradients_match_the_torch_code(name: str) -> None:
    _, _, moments, mass, shift, beta_u, beta_a = _case(SHAPES[name])
    ins = [t.clone().requires_grad_() for t in (moments, mass, beta_u, beta_a)]
    got = triton_m_step(ins[0], ins[1], shift, ins[2], ins[3], 0.37, EPS, VAR_EPS)
    ref = [t.clone().requires_grad_() for t in (moments, mass, beta_u, beta_a)]
    lam = 0.37 / (1.0 - 0.95)  # _m_step's lambda at t = 0: final_lambda (1 - 0.95)
    want = procedure._m_step(ref[0], ref[1], shift.transpose(1, 2), ref[2], ref[3],
                             final_lambda=lam, t=0, standardize=False)  # fmt: skip
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(3)
    outs = [torch.randn(t.shape, generator=g, dtype=F64) for t in got]
    for a, b in zip(torch.autograd.grad(got, ins, outs), torch.autograd.grad(want, ref, outs),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("used", [(0,), (1,), (2, 3), (0, 3)], ids=str)
def test_outputs_without_a_gradient_are_neither_materialized_nor_read(
    used: tuple[int, ...],
) -> None:
    """An M-step whose ``mu`` and ``act`` only the last iteration uses, and whose ``qp`` and
    ``c`` the last does not: the outputs left out get no zero tensor (the kernel takes flags
    instead), and the gradients equal the torch code's."""
    from capsctl.layers.backend.triton import aot as gpu_aot

    _, _, moments, mass, shift, beta_u, beta_a = _case(SHAPES["matrix"])
    ins = [t.clone().requires_grad_() for t in (moments, mass, beta_u, beta_a)]
    ref = [t.clone().requires_grad_() for t in (moments, mass, beta_u, beta_a)]
    got = triton_m_step(ins[0], ins[1], shift, ins[2], ins[3], 0.37, EPS, VAR_EPS)
    want = procedure._m_step(ref[0], ref[1], shift.transpose(1, 2), ref[2], ref[3],
                             final_lambda=0.37 / 0.05, t=0, standardize=False)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    outs = [torch.randn(got[i].shape, generator=g, dtype=F64) for i in used]
    # (mu alone does not depend on beta_a: its gradient is zero, None in the torch code)
    got_grads = torch.autograd.grad([got[i] for i in used], ins, outs, materialize_grads=True)
    want_grads = torch.autograd.grad([want[i] for i in used], ref, outs, materialize_grads=True)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    with gpu_aot.capturing() as launches:
        s = moments.float().requires_grad_()
        outs32 = triton_m_step(s, mass.float(), shift.float(), beta_u.float(), beta_a.float(),
                               0.37, EPS, VAR_EPS)  # fmt: skip
        sum(outs32[i].sum() for i in used).backward()
    flags = dict(next(x for x in launches if x.kernel == "m_step_backward").constexprs)
    given = [flags[k] for k in ("G_MU", "G_ACT", "G_QP", "G_C")]
    assert given == [i in used for i in range(4)]


def test_wide_parents_split_between_programs() -> None:
    """cifar100-em's class layer (100 parents of 6x6 poses): one program held all 128 padded
    parents' ``[64, 128]`` tiles, 255 registers and a spill on sm_90a. The M-step is
    independent across parents, so a program holds at most 1,024 entries: 16 parents, 7
    programs a block of sites."""
    meta, grid = mstep_ops._meta(torch.empty(2, 128, 36, 100))
    assert (meta["DP"], meta["MP"], meta["BB"]) == (64, 16, 1)
    assert grid == (128, 7)
    meta, grid = mstep_ops._meta(torch.empty(2, 128, 16, 10))  # 4x4 poses: one block of parents
    assert (meta["MP"], grid[1]) == (16, 1)


def test_the_m_step_passes_gradcheck_and_opcheck() -> None:
    _, _, moments, mass, shift, beta_u, beta_a = _case(SHAPES["vector-1"])
    ins = [t.clone().requires_grad_() for t in (moments, mass, beta_u, beta_a)]

    def step(s, m, bu, ba):  # type: ignore[no-untyped-def]
        return triton_m_step(s, m, shift, bu, ba, 0.5, EPS, VAR_EPS)

    assert torch.autograd.gradcheck(step, ins)
    f32 = [t.float() for t in (moments, mass[:, :, 0], shift, beta_u, beta_a)]
    torch.library.opcheck(torch.ops.capsctl.triton_m_step.default, (*f32, [0.5, EPS, VAR_EPS]))
    s = f32[0]
    grads = (torch.randn(s.shape[1:]), None, torch.randn(s.shape), None)  # mu, act, qp, c
    args = (*f32, [0.5, EPS, VAR_EPS], *grads)
    torch.library.opcheck(torch.ops.capsctl.triton_m_step_backward.default, args)


def test_em_routing_runs_its_m_step_as_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from capsctl.config import build_model
    from capsctl.layers.backend.triton import aot as gpu_aot

    def no_torch_m_step(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch M-step ran where the Triton kernels run")

    monkeypatch.setattr(procedure, "_m_step", no_torch_m_step)
    torch.manual_seed(0)
    tiny = {"primary_types": 2, "primary_dim": 4, "input_size": 8, "num_classes": 2}
    layers = [{"kind": "conv", "types": 2, "pose_dim": 4, "kernel": 3, "stride": 1}]
    net = build_model({"base": "cifar10-em-simple", **tiny, "layers": layers}).train()
    with gpu_aot.capturing() as launches:  # recorded, not run: the values are not looked at
        net(torch.randn(2, 3, 8, 8)).sum().backward()
    kernels = [launch.kernel for launch in launches]
    # 3 iterations in each of the two routed layers
    assert kernels.count("m_step_forward") == 6 and kernels.count("m_step_backward") == 6


def _em_inputs():  # type: ignore[no-untyped-def]
    """Child poses ``xs[B, J, a*x]``, weights ``[J, x, m, c]``, activations ``[B, J]`` of a
    small FC EM layer (4x4 poses)."""
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(3, 4, 16, generator=g)
    weight = torch.randn(4, 4, 2, 4, generator=g) * 0.3
    return xs, weight, torch.rand(3, 4, generator=g)


def test_cost_standardization_stays_torch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args: object, **kwargs: object) -> None:
        raise AssertionError("the M-step kernel has no cost standardization")

    xs, weight, a_in = _em_inputs()
    beta = torch.zeros(2)
    with dispatch.use("chunked"):
        want = procedure.em_routing_chunked(xs, weight, a_in, beta, beta, 3, 1.0, rows=4,
                                            standardize_costs=True)  # fmt: skip
    monkeypatch.setattr(procedure, "_triton_m_step", no_kernel)
    with dispatch.use("triton"):
        got = procedure.em_routing_chunked(xs, weight, a_in, beta, beta, 3, 1.0, rows=4,
                                           standardize_costs=True)  # fmt: skip
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-4, atol=1e-5)


def test_a_failing_m_step_kernel_falls_back_to_the_torch_code(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Failing:
        def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
            def launch(*args: object, **kwargs: object) -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            return launch

    from capsctl.layers.routers.em.layer import EMLayer  # noqa: F401 - the layers' module

    monkeypatch.setattr(dispatch, "_FUSED_FAILED", {})
    monkeypatch.setattr(dispatch, "_FUSED_PROVEN", set())
    monkeypatch.setattr(mstep_kernels, "m_step_backward", Failing())
    xs, weight, a_in = _em_inputs()
    beta_u, beta_a = torch.zeros(2), torch.zeros(2)

    def run(backend: str):  # type: ignore[no-untyped-def]
        ins = [t.clone().requires_grad_() for t in (xs, weight, a_in)]
        with dispatch.use(backend):
            mu, act, *_ = procedure.em_routing_chunked(
                ins[0], ins[1], ins[2], beta_u, beta_a, 3, 0.1, rows=4
            )
            grads = torch.autograd.grad(mu.sum() + act.sum(), ins)
        return mu, act, grads

    want = run("chunked")
    with caplog.at_level(logging.WARNING):
        got = run("triton")
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], want[2], rtol=1e-3, atol=1e-4)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m_ for m_ in messages if "m_step pass" in m_], messages
