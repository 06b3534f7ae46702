"""The compiled routing loops (capsctl/layers/backend/native.py, bindings.py, csrc/): the routed
pass of inverted dot-product attention routing and dynamic routing, the weighted pass of
self-routing and EM routing's moments and quadratic form, against the equations written out as loops
here, against the torch code, over threads, through whole models, and what happens without a
compiler."""

from __future__ import annotations

import hashlib
import os
import platform
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import require_native
from routing_steps import assert_same_step, routing_model, training_step

from capsctl.layers.backend import agreement, bindings, dispatch, em_mstep, native
from capsctl.layers.passes.em_moments import VoteMoments, VoteQuad, vote_shift
from capsctl.layers.passes.routed import routed_pass
from capsctl.layers.passes.weighted import weighted_pass


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Forget the loaded library before and after the test (it reads the environment)."""
    native._load.cache_clear()
    yield
    monkeypatch.undo()
    native._load.cache_clear()


def _loop_routed(x, w, p, scale):  # noqa: ANN001, ANN202
    """Tsai et al. (2020), one routed pass, by loops: V_ij = X_i W_ij, A_ij = scale <V_ij, P_j>,
    R_i = softmax over the parents j of A_i, S_j = sum_i R_ij V_ij."""
    j_n, b_n = x.shape[0], x.shape[1]
    m_n = w.shape[2]
    s = torch.zeros(b_n, m_n, x.shape[2], w.shape[3], dtype=torch.float64)
    r = torch.zeros(j_n, b_n, m_n, dtype=torch.float64)
    for b in range(b_n):
        for i in range(j_n):
            votes = [x[i, b].double() @ w[i, :, j].double() for j in range(m_n)]  # [a, c] each
            logits = torch.stack([scale * (votes[j] * p[b, j].double()).sum() for j in range(m_n)])
            coef = torch.exp(logits - logits.max())
            coef = coef / coef.sum()
            r[i, b] = coef
            for j in range(m_n):
                s[b, j] += coef[j] * votes[j]
    return s, r


def _loop_weighted(x, w, r):  # noqa: ANN001, ANN202
    """S_j = sum_i R_ij X_i W_ij, by loops."""
    s = torch.zeros(x.shape[1], w.shape[2], x.shape[2], w.shape[3], dtype=torch.float64)
    for b in range(x.shape[1]):
        for i in range(x.shape[0]):
            for j in range(w.shape[2]):
                s[b, j] += r[i, b, j].double() * (x[i, b].double() @ w[i, :, j].double())
    return s


# (J, B, a, x, m, c): 4x4 poses and 16-d pose vectors with the compiled sizes (32, 16 and 10
# parents), 4x4 poses with a run-time one, a single parent, other vector poses, a single child;
# more sites than one block of the loops (16) in some
SHAPES = [
    (9, 21, 4, 4, 32, 4),
    (6, 19, 4, 4, 16, 4),
    (7, 6, 4, 4, 10, 4),
    (5, 18, 1, 16, 32, 16),
    (4, 17, 1, 16, 16, 16),
    (4, 5, 1, 16, 10, 16),
    (5, 4, 4, 4, 3, 4),
    (6, 3, 4, 4, 1, 4),
    (8, 5, 1, 8, 3, 16),
    (1, 4, 2, 3, 2, 5),
    (3, 70, 1, 16, 10, 16),  # forward passes of 16-d vectors run 64 sites a block: two blocks
]


def _inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    j, b, a, xd, m, c = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(j, b, a, xd, generator=g)
    w = torch.randn(j, xd, m, c, generator=g) * 0.5
    p = torch.randn(b, m, a, c, generator=g)
    return x, w, p


def _self_inputs(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, ...]:
    """Self-routing's ``act[B, J]``, ``x``, ``w``, ``wr[J, a*x, m]`` and ``br[J, m]``."""
    j, b, a, xd, m, _ = shape
    x, w, _ = _inputs(shape, seed)
    g = torch.Generator().manual_seed(seed + 1)
    act = torch.rand(b, j, generator=g)
    return act, x, w, torch.randn(j, a * xd, m, generator=g), torch.randn(j, m, generator=g)


@pytest.mark.parametrize("shape", SHAPES)
def test_routed_pass_matches_the_equations(shape: tuple[int, ...]) -> None:
    require_native()
    x, w, p = _inputs(shape, 0)
    s, r = routed_pass(x, w, p, 0.25)
    ref_s, ref_r = _loop_routed(x, w, p, 0.25)
    assert torch.allclose(s.double(), ref_s, rtol=1e-5, atol=1e-5)
    assert torch.allclose(r.double(), ref_r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_weighted_pass_matches_the_equations(shape: tuple[int, ...]) -> None:
    require_native()
    x, w, _ = _inputs(shape, 1)
    r = torch.rand(shape[0], shape[1], shape[4], generator=torch.Generator().manual_seed(2))
    s = weighted_pass(x, w, r)
    assert torch.allclose(s.double(), _loop_weighted(x, w, r), rtol=1e-5, atol=1e-5)


def _grads(fn, inputs, seed):  # noqa: ANN001, ANN202
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return [out, *torch.autograd.grad(out, leaves, g)]


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_equal_those_of_the_torch_code(shape: tuple[int, ...]) -> None:
    """The torch code's gradients are checked against finite differences (passes/test_routed.py,
    routers/test_selfrouting.py); the compiled backward passes must give the same."""
    require_native()
    x, w, p = _inputs(shape, 3)
    r = torch.rand(shape[0], shape[1], shape[4], generator=torch.Generator().manual_seed(4))

    def routed(x, w, p):  # noqa: ANN001, ANN202
        return routed_pass(x, w, p, 0.5)[0]

    for fn, inputs in ((routed, (x, w, p)), (weighted_pass, (x, w, r))):
        _assert_grads_of_the_torch_code(fn, inputs, 5, shape)


def _assert_grads_of_the_torch_code(fn, inputs, seed, label) -> None:  # noqa: ANN001
    """``fn``'s outputs and gradients on the default backend equal the chunked torch code's."""
    fast = _grads(fn, inputs, seed)
    with dispatch.use("chunked"):
        slow = _grads(fn, inputs, seed)
    for got, want in zip(fast, slow, strict=True):
        # float32 rounding grows with a gradient's scale (w's sums over sites reach 20)
        tol = 1e-5 * max(1.0, want.abs().max().item())
        assert torch.allclose(got, want, rtol=1e-5, atol=tol), (fn, label)


def _loop_em(x, wc, shift, r, act, qp):  # noqa: ANN001, ANN202
    """EM's vote-sized sums by loops over u = X_i W_ij - shift_j (votes about a shift):
    S1_j = sum_i r_ij a_i u_ij, S2_j = sum_i r_ij a_i u_ij^2, the mass M_j = sum_i r_ij a_i
    and Q_ij = sum_h (q_j u_ij + p_j u_ij^2)."""
    j_n, b_n, a, xd = x.shape
    m = r.shape[2]  # r[B, J, m]
    c = wc.shape[2] // m
    w = wc.double().view(j_n, xd, c, m)
    s = torch.zeros(2, b_n, a * c, m, dtype=torch.float64)
    q = torch.zeros(b_n, j_n, m, dtype=torch.float64)
    mass = torch.zeros(b_n, m, 1, dtype=torch.float64)
    for b in range(b_n):
        for i in range(j_n):
            for k in range(m):
                mass[b, k, 0] += r[b, i, k] * act[b, i]
                u = (x[i, b].double() @ w[i, :, :, k]).flatten() - shift[b, :, k].double()
                s[0, b, :, k] += r[b, i, k] * act[b, i] * u
                s[1, b, :, k] += r[b, i, k] * act[b, i] * u * u
                q[b, i, k] = (qp[0, b, :, k] * u + qp[1, b, :, k] * u * u).sum()
    return s, q, mass


@pytest.mark.parametrize("shape", SHAPES)
def test_em_sums_match_the_equations_and_the_torch_code(shape: tuple[int, ...]) -> None:
    require_native()
    j, b, a, xd, m, c = shape
    g = torch.Generator().manual_seed(10)
    x = torch.randn(j, b, a, xd, generator=g)
    wc = torch.randn(j, xd, c * m, generator=g) * 0.5
    act = torch.rand(b, j, generator=g)
    r = torch.rand(b, j, m, generator=g)
    qp = torch.randn(2, b, a * c, m, generator=g)
    shift = vote_shift(x.permute(1, 0, 2, 3).contiguous(), wc, act, m)  # [B, d, m]
    want_s, want_q, want_mass = _loop_em(x, wc, shift, r, act, qp)
    got_s, got_mass = VoteMoments.apply(r, act, x, wc, shift)
    assert torch.allclose(got_s.double(), want_s, atol=1e-4)
    assert torch.allclose(got_mass.double(), want_mass, atol=1e-5)
    assert torch.allclose(VoteQuad.apply(qp, x, wc, shift).double(), want_q, atol=1e-4)

    def moments(r, act, x, wc):  # noqa: ANN001, ANN202
        return torch.cat([t.flatten() for t in VoteMoments.apply(r, act, x, wc, shift)])

    def quad(qp, x, wc):  # noqa: ANN001, ANN202
        return VoteQuad.apply(qp, x, wc, shift)

    for fn, inputs in ((moments, (r, act, x, wc)), (quad, (qp, x, wc))):
        fast = _grads(fn, inputs, 11)
        with dispatch.use("chunked"):
            slow = _grads(fn, inputs, 11)
        for got, want in zip(fast, slow, strict=True):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (fn, shape)


@pytest.mark.parametrize("shape", SHAPES)
def test_self_routing_pass_equals_the_torch_code(shape: tuple[int, ...]) -> None:
    """Self-routing's logits, coefficients, mass and weighted sum in one compiled pass
    (:class:`~capsctl.layers.passes.gated.GatedPass`): poses, activations, coefficients and
    every gradient (the activations', the poses' and the three weights') as the torch code's
    (whose gradients are checked against finite differences in routers/test_selfrouting.py)."""
    require_native()
    from capsctl.layers.passes.gated import gated_pass

    act, x, w, wr, br = _self_inputs(shape, 12)

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (act, x, w, wr, br)]
        u, parent, coef = gated_pass(*leaves)
        seeds = torch.Generator().manual_seed(14)
        gu, gp = torch.randn(u.shape, generator=seeds), torch.randn(parent.shape, generator=seeds)
        return [u, parent, coef, *torch.autograd.grad((u, parent), leaves, (gu, gp))]

    fast = run()
    with dispatch.use("chunked"):
        slow = run()
    # float32 rounding grows with a gradient's scale (act's reaches 1,500 here); act's gradient
    # sums terms as large as the poses' gradient (sum_d V gs), which at J = 1 cancel to nearly 0
    scales = [max(1.0, t.abs().max().item()) for t in slow]
    scales[3] = max(scales[3], scales[4])  # act's gradient, on the poses' scale
    for got, want, scale in zip(fast, slow, scales, strict=True):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale), shape


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[7]])
def test_weight_gradients_start_from_zero_in_uninitialized_accumulators(
    shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loops zero each thread's accumulator where they first touch it; filled with NaN
    (memory as it may come), the weights' gradients must still be those of the torch code.
    Per pair (4x4 and odd shapes) and per block (16-d vectors), threads and self-routing too."""
    require_native()
    from capsctl.layers.passes.gated import gated_pass

    monkeypatch.setattr(bindings, "_accumulator", lambda x, shape: x.new_full(shape, float("nan")))
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", "2")
    _, _, p = _inputs(shape, 31)
    act, x, w, wr, br = _self_inputs(shape, 31)

    def grads() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (w, wr, br)]
        s, _ = routed_pass(x, leaves[0], p, 0.5)
        u, parent, _ = gated_pass(act, x, *leaves)
        loss = s.square().sum() + u.square().sum() + parent.sum()
        return list(torch.autograd.grad(loss, leaves))

    fast = grads()
    with dispatch.use("chunked"):
        slow = grads()
    for got, want in zip(fast, slow, strict=True):
        tol = 1e-5 * max(1.0, want.abs().max().item())
        assert torch.allclose(got, want, rtol=1e-5, atol=tol), shape


def test_the_compiled_loops_run_the_default_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without this the tests above could pass by running the torch code twice."""
    require_native()
    calls = []
    real = bindings.routed_forward

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bindings, "routed_forward", spy)
    x, w, p = _inputs(SHAPES[0], 6)
    routed_pass(x, w, p, 0.5)
    assert calls
    calls.clear()
    with dispatch.use("chunked"):
        routed_pass(x, w, p, 0.5)
    routed_pass(x.double(), w.double(), p.double(), 0.5)  # float64: the torch code
    assert not calls


def test_tracing_for_export_never_runs_the_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``dispatch.use("dense")`` (ONNX and torch.export) every pass is one torch
    expression."""
    require_native()
    from capsctl.layers.passes.gated import gated_pass

    calls = []
    for name in ("routed_forward", "weighted_forward", "gated_forward"):
        real = getattr(bindings, name)

        def spy(*args, _real=real, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(bindings, name, spy)
    x, w, p = _inputs(SHAPES[1], 15)
    j, bsz, a, xd = x.shape
    m = w.shape[2]
    wr, br = torch.randn(j, a * xd, m), torch.randn(j, m)
    act = torch.rand(bsz, j)  # [B, J]
    gated_pass(act, x, w, wr, br)
    routed_pass(x, w, p, 0.5)
    assert len(calls) == 2  # the compiled loops by default
    calls.clear()
    with dispatch.use("dense"):
        gated_pass(act, x, w, wr, br)
        routed_pass(x, w, p, 0.5)
        weighted_pass(x, w, torch.rand(j, bsz, m))
    assert not calls


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_threads_give_the_results_of_one_thread(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_native()
    x, w, p = _inputs((9, 13, 4, 4, 10, 4), 7)
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", "1")
    want = _grads(lambda *t: routed_pass(*t, 0.5)[0], (x, w, p), 8)
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", threads)
    got = _grads(lambda *t: routed_pass(*t, 0.5)[0], (x, w, p), 8)
    s, gx, gw, gp = got
    # every site is computed alike, whichever thread runs it
    assert torch.equal(s, want[0]) and torch.equal(gx, want[1]) and torch.equal(gp, want[3])
    assert torch.allclose(gw, want[2], rtol=1e-6, atol=1e-6)  # dW: a sum per thread, then added


@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_backward_passes_of_vectors_over_several_blocks_equal_the_torch_code(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward passes of 16-d pose vectors keep the votes' gradients of a block of 64
    sites (csrc/votes.h, backward_block): 150 sites give each thread blocks that start past its
    first site and a last block that is not full. Routed, weighted and self-routing passes."""
    require_native()
    from capsctl.layers.passes.gated import gated_pass

    shape = (3, 150, 1, 16, 32, 16)
    x, w, p = _inputs(shape, 41)
    act, _, _, wr, br = _self_inputs(shape, 41)
    r = torch.rand(shape[0], shape[1], shape[4], generator=torch.Generator().manual_seed(42))

    def routed(x, w, p):  # noqa: ANN001, ANN202
        return routed_pass(x, w, p, 0.5)[0]

    def gated(act, x, w, wr, br):  # noqa: ANN001, ANN202
        u, parent, _ = gated_pass(act, x, w, wr, br)
        return u + parent[:, :, None, None]  # [B, m, a, c]: both outputs in one loss

    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", threads)
    cases = ((routed, (x, w, p)), (weighted_pass, (x, w, r)), (gated, (act, x, w, wr, br)))
    for fn, inputs in cases:
        _assert_grads_of_the_torch_code(fn, inputs, 43, threads)


@pytest.mark.parametrize("threads", ["2", "3"])
def test_threads_give_the_results_of_one_thread_in_self_routing(
    threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights' three gradients (pose weights, routing weights, biases) share one
    accumulator per thread."""
    require_native()
    from capsctl.layers.passes.gated import gated_pass

    act, x, w, wr, br = _self_inputs((9, 13, 4, 4, 10, 4), 7)

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (act, x, w, wr, br)]
        u, parent, _ = gated_pass(*leaves)
        return list(torch.autograd.grad((u.sum() + parent.square().sum()), leaves))

    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", "1")
    want = run()
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", threads)
    got = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # per site
    for gw, ww in zip(got[2:], want[2:], strict=True):  # a sum per thread, then added
        assert torch.allclose(gw, ww, rtol=1e-6, atol=1e-6)


def test_self_routing_gradients_of_one_output_alone() -> None:
    """Only the parent activations (or only the poses) in the loss: the pass gets no gradient
    for the other output and must treat it as zero."""
    require_native()
    from capsctl.layers.passes.gated import gated_pass

    act, x, w, wr, br = _self_inputs((9, 13, 4, 4, 10, 4), 21)
    for pick in (0, 1):

        def run(pick: int = pick) -> list[torch.Tensor]:
            leaves = [t.clone().requires_grad_(True) for t in (act, x, w, wr, br)]
            out = gated_pass(*leaves)[pick]
            grads = torch.autograd.grad(out.square().sum(), leaves, allow_unused=True)
            return [torch.zeros(()) if t is None else t for t in grads]

        fast = run()
        with dispatch.use("chunked"):
            slow = run()
        for got, want in zip(fast, slow, strict=True):
            assert torch.allclose(
                got, want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item())
            )


def test_the_fused_self_routing_pass_counts_the_logits_flops() -> None:
    """The compiled pass computes the routing logits inside; the FLOP count must not change."""
    require_native()
    from capsctl.compare.flops import count_flops
    from capsctl.config import build_model, resolve_config

    tiny = {"base": "mnist-caps", "primary_types": 4, "router": {"name": "self"}}
    model = build_model(resolve_config({**tiny, "layers": [{"kind": "conv", "types": 4}]}))
    fused = count_flops(model, [1, 28, 28])
    with dispatch.use("chunked"):
        assert count_flops(model, [1, 28, 28]) == pytest.approx(fused, rel=1e-12)


@pytest.mark.parametrize("router", ["idpa", "self", "dynamic", "em"])
def test_a_training_step_equals_the_torch_code(router: str) -> None:
    require_native()
    model = routing_model(router)
    x = torch.randn(2, 3, 32, 32)
    fast = training_step(model, x)
    with dispatch.use("chunked"):
        slow = training_step(model, x)
    # a gradient that is zero but for rounding (about 1e-13 here) is compared on the scale of
    # the largest one; EM's class-layer weights get a gradient of 4e-6 of the largest, a sum of
    # terms that cancel, which float32 gets to about 1e-3 of itself in the torch code and in
    # the loops alike (against float64), so EM's is compared on 1e-4 of the largest
    assert_same_step(fast, slow, floor=1e-4 if router == "em" else 1e-6)


def test_ems_m_step_runs_as_the_loops_and_equals_the_torch_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EM routing's parent-sized M-step (csrc/em_mstep.cpp) in a whole routing, forward and
    backward, against the torch code (procedure._m_step, which the loops must not call)."""
    from capsctl.layers.routers.em import procedure

    require_native()
    g = torch.Generator().manual_seed(4)
    xs = torch.randn(6, 8, 16, generator=g)  # [B, J, a*x]: 4x4 poses
    weight = torch.randn(8, 4, 5, 4, generator=g) * 0.3  # [J, x, m, c]
    a_in = torch.rand(6, 8, generator=g)
    beta_u, beta_a = torch.randn(5, generator=g), torch.randn(5, generator=g)

    def route() -> tuple[torch.Tensor, ...]:
        ins = [t.clone().requires_grad_() for t in (xs, weight, a_in, beta_u, beta_a)]
        mu, act, *_ = procedure.em_routing_chunked(
            ins[0], ins[1], ins[2], ins[3], ins[4], 3, 0.5, rows=4
        )
        loss = (mu * torch.linspace(-1, 1, mu.numel()).view(mu.shape)).sum() + act.sum()
        return (mu, act, *torch.autograd.grad(loss, ins))

    with dispatch.use("chunked"):
        want = route()
    real = procedure._m_step

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch M-step ran where the compiled loops run")

    monkeypatch.setattr(procedure, "_m_step", refuse)
    got = route()
    monkeypatch.setattr(procedure, "_m_step", real)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-4, atol=1e-4 * float(b.detach().abs().max()))


def test_the_self_test_passes_when_first_loaded_under_autocast(fresh_load: None) -> None:
    """A model's first pass often runs under bf16 autocast (training with ``train.amp``): the
    self-test must compare the loops with float32 torch code there too, not with bf16 results
    (which differ by far more than its tolerance), or the loops are switched off for the
    process and the library is rebuilt."""
    require_native()
    native._load.cache_clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        status = native.native_status()
    assert status.startswith("on"), status


def test_loading_the_library_leaves_the_processs_float_mode_alone() -> None:
    """The library is linked without ``-ffast-math``: with it the compiler links
    crtfastmath.o, whose constructor flushes subnormal floats to zero for the whole process
    that loads the library, the user's own computations included (training flushes them in
    its own scope, capsctl.devices.flush_denormals)."""
    require_native()  # built into the cache this process and the one below share
    code = (
        "from capsctl.devices import denormals_flushed as flushed\n"
        "assert not flushed()\n"
        "from capsctl.layers.backend import native\n"
        "assert native.loaded() is not None\n"
        "print(flushed())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_library_is_built_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    assert native.native_status().startswith("on")
    built = sorted((tmp_path / "kernels").iterdir())
    # no temporary file left behind: the library and the checksum written when it was built
    assert [p.name for p in built[1:]] == [built[0].name + ".sha256"]
    assert built[0].suffix == ".so"
    built = built[:1]
    stamp = built[0].stat().st_mtime_ns
    native._load.cache_clear()
    assert native.native_status() == f"on ({built[0]})"
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt


def test_a_change_to_any_source_builds_a_new_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    """The cache key covers every source built into the library, the LayerNorm's and the
    shared header too: an upgrade that changes only one of them must not load the old build."""
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    assert native.native_status().startswith("on")
    copies = {}
    for source in (*native.SOURCES, *native.HEADERS):
        copy = tmp_path / "src" / source.name
        copy.parent.mkdir(exist_ok=True)
        copy.write_text(source.read_text())
        copies[source.name] = copy
    monkeypatch.setattr(native, "SOURCES", tuple(copies[s.name] for s in native.SOURCES))
    monkeypatch.setattr(native, "HEADERS", tuple(copies[h.name] for h in native.HEADERS))
    cxx = native._compiler()
    assert cxx is not None
    names = {native._library_name(cxx)}
    for changed in copies.values():  # every source and header: a library of its own name
        with changed.open("a") as f:
            f.write("// changed\n")
        names.add(native._library_name(cxx))
    assert len(names) == len(copies) + 1
    # and a new name is built, not loaded from the old build (one build here: a second is slow)
    native._load.cache_clear()
    assert native.native_status().startswith("on")
    assert len(list((tmp_path / "cache" / "kernels").glob("*.so"))) == 2


def test_the_library_is_built_from_every_file_of_csrc() -> None:
    """Every source of csrc/ is compiled and every header is part of the cache key (a header
    added there is covered without a list to update), and the ABI version is written once, in
    csrc/abi.h, which abi.cpp reports."""
    files = sorted(native.CSRC.iterdir())
    assert list(native.SOURCES) == [f for f in files if f.suffix == ".cpp"]
    assert list(native.HEADERS) == [f for f in files if f.suffix == ".h"]
    assert {f.suffix for f in files} == {".cpp", ".h"}
    abi = (native.CSRC / "abi.h").read_text()
    assert f"#define CAPSCTL_KERNELS_ABI {native.ABI}\n" in abi
    for source in (*native.SOURCES, *native.HEADERS):
        if source.name != "abi.h":
            assert "CAPSCTL_KERNELS_ABI " not in source.read_text().replace(
                "return CAPSCTL_KERNELS_ABI;", ""
            ), source.name
    # one extern "C" function of the library per Python binding (bindings.py, em_mstep.py,
    # agreement.py), and
    # the ABI's
    exported = set()
    for source in native.SOURCES:
        exported |= set(re.findall(r"\b(?:void|int) capsctl_(\w+)\(", source.read_text()))
    assert exported == {*native.ARGTYPES, "kernels_abi"}
    modules = (bindings, em_mstep, agreement)
    assert all(any(hasattr(mod, name) for mod in modules) for name in native.ARGTYPES)


def _cpu_has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_on_an_avx512_cpu_the_loops_use_512_bit_vectors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    # GCC 12 and clang otherwise stop at 256-bit vectors on AVX-512 CPUs (1.7x slower loops)
    objdump = shutil.which("objdump")
    if native._compiler() is None or objdump is None:
        pytest.skip("no C++ compiler or no objdump")
    if platform.machine().lower() not in ("x86_64", "amd64") or not _cpu_has_avx512():
        pytest.skip("not an x86-64 CPU with AVX-512")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    assert native.native_status().startswith("on")
    (built,) = (tmp_path / "kernels").glob("*.so")
    listing = subprocess.run([objdump, "-d", str(built)], capture_output=True, text=True).stdout
    assert "%zmm" in listing


def test_on_an_avx512_cpu_the_avx2_bodies_of_the_loops_pass_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    """CPUs without AVX-512 compile other bodies of some loops (8-float vectors kept in AVX2's
    16 registers): built here with AVX-512 off, they pass the library's self-test against the
    torch code (every pass, both ways) and hold no 512-bit instruction. On a CPU without
    AVX-512 every other test of the loops runs them."""
    objdump = shutil.which("objdump")
    if native._compiler() is None or objdump is None:
        pytest.skip("no C++ compiler or no objdump")
    if platform.machine().lower() not in ("x86_64", "amd64") or not _cpu_has_avx512():
        pytest.skip("not an x86-64 CPU with AVX-512 (the default build is the AVX2 one)")
    monkeypatch.setattr(native, "X86_FLAGS", (*native.X86_FLAGS, "-mno-avx512f"))
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    status = native.native_status()
    assert status.startswith("on"), status
    (built,) = (tmp_path / "kernels").glob("*.so")
    listing = subprocess.run([objdump, "-d", str(built)], capture_output=True, text=True).stdout
    assert "%zmm" not in listing
    _same_as_torch()


def test_the_512_bit_flag_is_only_passed_on_x86_64() -> None:
    assert "-mprefer-vector-width=512" in native.build_flags("x86_64")
    assert "-mprefer-vector-width=512" in native.build_flags("AMD64")
    for machine in ("aarch64", "arm64", "ppc64le"):
        flags = native.build_flags(machine)
        assert "-march=native" in flags
        assert not any(f.startswith("-mprefer-vector-width") for f in flags)


def test_an_unwritable_cache_falls_back_to_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))  # cannot be created
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    status = native.native_status()
    assert status.startswith(f"on ({temp / f'capsctl-kernels-{os.getuid()}'}"), status
    assert stat.S_IMODE((temp / f"capsctl-kernels-{os.getuid()}").stat().st_mode) == 0o700
    _same_as_torch()


def _same_as_torch() -> None:
    x, w, p = _inputs(SHAPES[2], 9)
    s, r = routed_pass(x, w, p, 0.5)
    ref_s, ref_r = _loop_routed(x, w, p, 0.5)
    assert torch.allclose(s.double(), ref_s, rtol=1e-5, atol=1e-5)


def test_the_environment_turns_the_loops_off(
    monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.native_status() == "off (CAPSCTL_NATIVE=0)"
    assert dispatch.choose(torch.zeros(1)).backend != "native"
    _same_as_torch()


def test_without_a_compiler_the_torch_code_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native.native_status().startswith("off (no C++ compiler found")
    _same_as_torch()


def test_a_failing_compiler_leaves_the_torch_code_and_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'error: out of luck' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    cache = tmp_path / "cache"
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    status = native.native_status()
    assert status.startswith("off (") and "out of luck" in status, status
    assert not any((cache / "kernels").iterdir())  # the temporary output was removed
    _same_as_torch()


# -- what is loaded, and only after checks (issue 26: planted, truncated and fake libraries) --


@pytest.fixture(scope="module")
def real_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A library built once for this module's tests from the real sources (in a cache of its own,
    never the user's); the tests below hand out copies of it through a fake compiler."""
    if native._compiler() is None:
        pytest.skip("no C++ compiler")
    cache = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(native.CACHE_ENV, str(cache))
        mp.delenv(native.NATIVE_ENV, raising=False)
        native._load.cache_clear()
        status = native.native_status()
        native._load.cache_clear()
    assert status.startswith("on ("), status
    return Path(status[len("on (") : -1])


def _c_library(tmp_path: Path, name: str, source: str) -> Path:
    """A shared library compiled from the C ``source`` (a few milliseconds)."""
    src, out = tmp_path / f"{name}.c", tmp_path / f"{name}.so"
    src.write_text(source)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return out


def _planted(tmp_path: Path) -> tuple[Path, Path]:
    """Another user's library: its constructor writes a marker file when it is loaded."""
    marker = tmp_path / "planted-code-ran"
    source = (
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void planted(void) {\n"
        f'  FILE* f = fopen("{marker}", "w"); if (f) fclose(f);\n'
        "}\n"
        f"int capsctl_kernels_abi(void) {{ return {native.ABI}; }}\n"
    )
    return _c_library(tmp_path, "planted", source), marker


def _no_op_library(tmp_path: Path) -> Path:
    """Every function of the library, doing nothing (what a fake compiler might make)."""
    body = "".join(f"void capsctl_{n}(void) {{}}\n" for n in native.ARGTYPES)
    abi = f"int capsctl_kernels_abi(void) {{ return {native.ABI}; }}\n"
    return _c_library(tmp_path, "no-op", abi + body)


def _fake_compiler(tmp_path: Path, library: Path) -> Path:
    """A "compiler" that writes a copy of ``library`` to its ``-o`` argument."""
    script = tmp_path / "fake-c++"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "fake c++ 1.0"; exit 0; fi\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then cp '
        f'"{library}" "$2"; exit 0; fi; shift; done\n'
        "exit 1\n"
    )
    script.chmod(0o755)
    return script


def _fresh(monkeypatch: pytest.MonkeyPatch, cxx: str, cache: Path, temp: Path) -> None:
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    temp.mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    native._load.cache_clear()


def _name_for(monkeypatch: pytest.MonkeyPatch, cxx: str, tmp_path: Path) -> str:
    """The file name the library gets with compiler ``cxx`` (built once in a scratch cache)."""
    _fresh(monkeypatch, cxx, tmp_path / "scratch", tmp_path / "scratch-temp")
    status = native.native_status()
    assert status.startswith("on ("), status
    return Path(status[len("on (") : -1]).name


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= 30]


def test_a_library_planted_in_the_shared_temporary_folder_is_never_loaded(
    real_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    """Another user can write to /tmp: a library there under the expected name must not run,
    and the user's own (writable) cache is where the library is built."""
    fake = str(_fake_compiler(tmp_path, real_library))
    name = _name_for(monkeypatch, fake, tmp_path)
    planted, marker = _planted(tmp_path)
    temp = tmp_path / "temp"
    for folder in (temp / "capsctl-kernels", temp / f"capsctl-kernels-{os.getuid()}"):
        folder.mkdir(parents=True)
        shutil.copy(planted, folder / name)
    cache = tmp_path / "cache"
    _fresh(monkeypatch, fake, cache, temp)
    assert native.native_status() == f"on ({cache / 'kernels' / name})"
    assert not marker.exists()
    _same_as_torch()


@pytest.mark.parametrize("how", ["writable by others", "owned by another user"])
def test_a_folder_others_can_write_to_is_refused_with_a_warning(
    how: str,
    real_library: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_load: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    if how == "owned by another user" and os.getuid() != 0:
        pytest.skip("only root can give a folder to another user")
    fake = str(_fake_compiler(tmp_path, real_library))
    name = _name_for(monkeypatch, fake, tmp_path)
    planted, marker = _planted(tmp_path)
    cache, temp = tmp_path / "cache", tmp_path / "temp"
    folders = [cache / "kernels", temp / f"capsctl-kernels-{os.getuid()}"]
    for folder in folders:
        folder.mkdir(parents=True)
        shutil.copy(planted, folder / name)
        if how == "writable by others":
            folder.chmod(0o777)
        else:
            os.chown(folder, 12345, 12345)
    _fresh(monkeypatch, fake, cache, temp)
    caplog.set_level("WARNING", logger=native.__name__)
    status = native.native_status()
    assert status.startswith("off ("), status
    assert not marker.exists()
    for folder in folders:
        (line,) = [m for m in _warnings(caplog) if str(folder) in m]
        assert "\n" not in line and "chmod go-w" in line and native.CACHE_ENV in line
    _same_as_torch()


def test_another_users_file_in_the_private_cache_is_rebuilt_not_loaded(
    real_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    fake = str(_fake_compiler(tmp_path, real_library))
    name = _name_for(monkeypatch, fake, tmp_path)
    planted, marker = _planted(tmp_path)
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    target = cache / "kernels" / name
    shutil.copy(planted, target)
    target.chmod(0o666)  # anyone may have written it
    data = target.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (cache / "kernels" / f"{name}.sha256").write_text(f"{digest} {len(data)}\n")
    _fresh(monkeypatch, fake, cache, tmp_path / "temp")
    assert native.native_status() == f"on ({target})"
    assert not marker.exists()
    assert stat.S_IMODE(target.stat().st_mode) & 0o022 == 0
    _same_as_torch()


def _status_in_a_new_process(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "from capsctl.layers import native_status; print(native_status())"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_a_truncated_library_in_the_cache_is_rebuilt_with_one_warning(
    real_library: Path, tmp_path: Path
) -> None:
    """A truncated library would kill the process with SIGBUS when loaded; it is checked
    against the checksum written when it was built, and rebuilt."""
    fake = _fake_compiler(tmp_path, real_library)
    cache = tmp_path / "cache"
    env = {"CXX": str(fake), native.CACHE_ENV: str(cache), "TMPDIR": str(tmp_path)}
    env = {**env, native.NATIVE_ENV: "1"}
    first = _status_in_a_new_process(env)
    assert first.returncode == 0 and first.stdout.startswith("on ("), first
    library = Path(first.stdout.strip()[len("on (") : -1])
    assert library.with_name(library.name + ".sha256").is_file()
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2])  # truncated in place
    done = _status_in_a_new_process(env)
    assert done.returncode == 0, done
    assert done.stdout.strip() == f"on ({library})"
    (line,) = done.stderr.strip().splitlines()
    assert str(library) in line and "rebuilding" in line and "checksum" in line
    assert library.read_bytes() == data


def test_a_library_whose_loops_do_nothing_is_not_used(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_load: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fake compiler's no-op loops gave 10% accuracy and NaN losses: the self-test against
    the torch code refuses them, the torch code runs, nothing is cached."""
    fake = str(_fake_compiler(tmp_path, _no_op_library(tmp_path)))
    cache = tmp_path / "cache"
    _fresh(monkeypatch, fake, cache, tmp_path / "temp")
    caplog.set_level("WARNING", logger=native.__name__)
    status = native.native_status()
    assert status.startswith("off (") and "differs from the torch code" in status, status
    assert dispatch.choose(torch.zeros(1)).backend != "native"
    assert [p.name for p in (cache / "kernels").iterdir()] == []
    assert any("torch code" in m and native.NATIVE_ENV in m for m in _warnings(caplog))
    _same_as_torch()


def test_a_cached_library_that_fails_its_self_test_is_rebuilt_once(
    real_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    fake = str(_fake_compiler(tmp_path, real_library))
    name = _name_for(monkeypatch, fake, tmp_path)
    cache = tmp_path / "cache"
    (cache / "kernels").mkdir(parents=True, mode=0o700)
    target = cache / "kernels" / name
    shutil.copy(_no_op_library(tmp_path), target)
    data = target.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (cache / "kernels" / f"{name}.sha256").write_text(f"{digest} {len(data)}\n")
    _fresh(monkeypatch, fake, cache, tmp_path / "temp")
    assert native.native_status() == f"on ({target})"
    assert target.read_bytes() == real_library.read_bytes()
    _same_as_torch()


def test_a_compiler_command_with_arguments(
    real_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    """``CXX="ccache g++"``: the first word is the program, the rest its arguments."""
    fake = _fake_compiler(tmp_path, real_library)
    _fresh(monkeypatch, f"env {fake}", tmp_path / "cache", tmp_path / "temp")
    assert native.native_status().startswith(f"on ({tmp_path / 'cache'}"), native.native_status()
    _same_as_torch()


def test_each_source_compiles_in_a_process_of_its_own_then_one_link(
    real_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_load: None
) -> None:
    """The sources compile in parallel (the first use waits for the slowest, not the sum),
    and no object file is left behind."""
    fake = _fake_compiler(tmp_path, real_library)
    log = tmp_path / "calls.log"
    logging = tmp_path / "logging-c++"
    logging.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{fake}" "$@"\n')
    logging.chmod(0o755)
    cache = tmp_path / "cache"
    _fresh(monkeypatch, str(logging), cache, tmp_path / "temp")
    assert native.native_status().startswith("on (")
    calls = [line.split() for line in log.read_text().splitlines() if "--version" not in line]
    compiles = [c for c in calls if "-c" in c]
    assert sorted(c[c.index("-c") + 1] for c in compiles) == sorted(map(str, native.SOURCES))
    (link,) = [c for c in calls if "-c" not in c]
    objects = [a for a in link if a.endswith(".o")]
    assert sorted(objects) == sorted(c[c.index("-o") + 1] for c in compiles)
    assert [p.suffix for p in (cache / "kernels").iterdir()] in (
        [".so", ".sha256"],
        [".sha256", ".so"],
    )
    assert native._build_workers() >= 1


def test_the_first_build_is_announced_in_one_line(
    real_library: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fresh_load: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = str(_fake_compiler(tmp_path, real_library))
    cache = tmp_path / "cache"
    _fresh(monkeypatch, fake, cache, tmp_path / "temp")
    caplog.set_level("WARNING", logger=native.__name__)
    assert native.native_status().startswith("on (")
    (line,) = _warnings(caplog)
    assert "compiling" in line and str(cache / "kernels") in line and "\n" not in line
    caplog.clear()
    native._load.cache_clear()
    assert native.native_status().startswith("on (")
    assert _warnings(caplog) == []  # from the cache: no notice


@pytest.mark.parametrize("variable", ["HOME", "XDG_CACHE_HOME"])
def test_an_empty_home_or_xdg_cache_home_counts_as_unset(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    monkeypatch.setenv(variable, "")
    if variable == "XDG_CACHE_HOME":
        monkeypatch.setenv("HOME", "/home/someone")
        assert native._cache_dir() == Path("/home/someone/.cache/capsctl")
        return
    home = pwd.getpwuid(os.getuid()).pw_dir
    assert native._cache_dir() == Path(home) / ".cache" / "capsctl"
    assert native._cache_dir() != Path("/.cache/capsctl")
