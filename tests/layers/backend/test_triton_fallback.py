"""A fused Triton pass that fails to import, compile or launch at real shapes, forward or
backward, makes that pass run as torch code with one warning naming the kernel, the shapes and
the reason (capsctl/layers/backend/dispatch.py, run_fused); the kernels run on the CPU under
Triton's interpreter."""

from __future__ import annotations

import ast
import logging
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from triton.compiler.errors import CompilationError  # noqa: E402

from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend.triton import kernels  # noqa: E402
from capsctl.layers.passes.em_moments import vote_moments  # noqa: E402
from capsctl.layers.passes.gated import gated_pass  # noqa: E402
from capsctl.layers.passes.routed import routed_pass  # noqa: E402

# x[J, B, a, x], w[J, x, m, c], p[B, m, a, c]
J, B, A, X, M, C = 5, 3, 4, 4, 3, 4


@pytest.fixture(autouse=True)
def fresh_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_FUSED_FAILED", {})
    monkeypatch.setattr(dispatch, "_FUSED_PROVEN", set())
    with dispatch.use("triton"):  # the kernels' self-test runs once, before any failure
        assert dispatch.takes_triton(torch.zeros(1))


def _routed_inputs(grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(J, B, A, X, generator=g)
    w = torch.randn(J, X, M, C, generator=g) / math.sqrt(X)
    p = torch.randn(B, M, A, C, generator=g)
    return tuple(t.requires_grad_(grad) for t in (x, w, p))


def _torch_routed(grad: bool = False) -> tuple[torch.Tensor, ...]:
    x, w, p = _routed_inputs(grad)
    with dispatch.use("chunked"):
        s, r = routed_pass(x, w, p, 0.25)
    if not grad:
        return s, r
    return (s, r, *torch.autograd.grad(s.sum(), (x, w, p)))


class _Failing:
    """Stands for a Triton kernel: launching it raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
        def launch(*args: object, **kwargs: object) -> None:
            raise self.error

        return launch


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


LAUNCH = RuntimeError("CUDA error: an illegal memory access was encountered")
COMPILE = CompilationError("src", ast.parse("x").body[0], "out of resource: shared memory")


@pytest.mark.parametrize("error", [LAUNCH, COMPILE], ids=["launch", "compile"])
def test_a_forward_kernel_that_fails_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    monkeypatch.setattr(kernels, "pass_forward", _Failing(error))
    want = _torch_routed()
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        for _ in range(2):  # the second call does not try the kernel again, nor warn again
            got = routed_pass(*_routed_inputs(), 0.25)
            torch.testing.assert_close(got, want)
    (message,) = _warnings(caplog)
    assert "routed pass" in message and type(error).__name__ in message
    assert f"{J}x{B}x{A}x{X} {J}x{X}x{M}x{C} {B}x{M}x{A}x{C}" in message
    assert "runs as torch code" in message


def test_a_backward_kernel_that_fails_falls_back_before_training_relies_on_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kernels, "pass_backward", _Failing(LAUNCH))
    s_want, r_want, *grads_want = _torch_routed(grad=True)
    x, w, p = _routed_inputs(grad=True)
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        s, r = routed_pass(x, w, p, 0.25)
        grads = torch.autograd.grad(s.sum(), (x, w, p))
    torch.testing.assert_close((s, r), (s_want, r_want))
    torch.testing.assert_close(grads, tuple(grads_want))
    (message,) = _warnings(caplog)
    assert "illegal memory access" in message


def test_a_kernel_module_that_fails_to_import_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "capsctl.layers.backend.triton.ops", None)
    monkeypatch.setitem(sys.modules, "capsctl.layers.backend.triton.em_ops", None)
    monkeypatch.setitem(sys.modules, "capsctl.layers.backend.triton.gate_ops", None)
    want = _torch_routed()
    g = torch.Generator().manual_seed(1)
    act = torch.rand(B, J, generator=g)  # self-routing: child activations [B, J]
    wr, br = torch.randn(J, A * X, M, generator=g), torch.zeros(J, M)
    r = torch.softmax(torch.randn(B, J, M, generator=g), -1)  # EM: assignments [B, J, m]
    a_em = torch.rand(B, J, generator=g)
    x, w, _ = _routed_inputs()
    wc = w.transpose(2, 3).reshape(J, X, C * M)  # [J, x, c*m]
    shift = torch.zeros(B, A * C, M)  # [B, d, m]
    with dispatch.use("chunked"):
        gated_want = gated_pass(act, x, w, wr, br)
        em_want = vote_moments(r, a_em, x, wc, shift)
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        torch.testing.assert_close(routed_pass(*_routed_inputs(), 0.25), want)
        torch.testing.assert_close(gated_pass(act, x, w, wr, br), gated_want)
        torch.testing.assert_close(vote_moments(r, a_em, x, wc, shift), em_want)
    messages = _warnings(caplog)
    assert all("ModuleNotFoundError: import of" in m for m in messages)
    # self-routing's pass is its gate's kernels and the weighted pass's
    passes = [m.split(" pass ")[0].split()[-1] for m in messages]
    assert passes == ["routed", "gate", "weighted", "em_moments"]


@pytest.mark.parametrize("kernel", ["gate_forward", "gate_backward"])
def test_a_failing_gate_kernel_falls_back_to_torch_code(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kernel: str
) -> None:
    from capsctl.layers.backend.triton import gate

    g = torch.Generator().manual_seed(2)
    act = torch.rand(B, J, generator=g)  # [B, J]
    wr, br = torch.randn(J, A * X, M, generator=g), torch.randn(J, M, generator=g)
    x, w, _ = _routed_inputs()
    ins = (act, x, w, wr, br)
    with dispatch.use("chunked"):
        want_ins = [t.clone().requires_grad_() for t in ins]
        want = gated_pass(*want_ins)
        want_g = torch.autograd.grad(want[0].sum() + want[1].sum(), want_ins)
    monkeypatch.setattr(gate, kernel, _Failing(LAUNCH))
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        got_ins = [t.clone().requires_grad_() for t in ins]
        got = gated_pass(*got_ins)
        got_g = torch.autograd.grad(got[0].sum() + got[1].sum(), got_ins)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_g, want_g)
    (message,) = _warnings(caplog)
    assert "gate pass" in message and "illegal memory access" in message


def test_running_out_of_memory_is_not_a_kernel_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    # the torch code would need more memory, not less: the error reaches the caller
    monkeypatch.setattr(kernels, "pass_forward", _Failing(torch.OutOfMemoryError("out of memory")))
    with pytest.raises(torch.OutOfMemoryError), dispatch.use("triton"):
        routed_pass(*_routed_inputs(), 0.25)
    assert dispatch._FUSED_FAILED == {}


@pytest.mark.parametrize("kernel", ["em_estep_stats", "em_estep_input_grad"])
def test_a_failing_fused_e_step_kernel_falls_back_to_torch_code(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kernel: str
) -> None:
    """EM routing whose fused E-step and moments kernel fails, forward or backward: the routing
    runs the E-step, quadratic form and moments on their own instead, after one warning naming
    the pass, with the torch code's values and gradients."""
    from capsctl.layers.backend.triton import em_estep
    from capsctl.layers.routers.em.procedure import em_routing_chunked

    g = torch.Generator().manual_seed(3)
    xs = torch.randn(B, J, A * X, generator=g)  # [B, J, a*x]
    w = torch.randn(J, X, M, C, generator=g) * 0.3  # [J, x, m, c]
    act = torch.rand(B, J, generator=g)
    beta = torch.zeros(M)

    def routed(*ins: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mu, a_out = em_routing_chunked(*ins[:3], beta, beta, 3, 1.0, rows=A)[:2]
        return (mu, a_out, *torch.autograd.grad(mu.sum() + a_out.sum(), ins))

    with dispatch.use("chunked"):
        want = routed(*(t.clone().requires_grad_() for t in (xs, w, act)))
    monkeypatch.setattr(em_estep, kernel, _Failing(LAUNCH))
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        got = routed(*(t.clone().requires_grad_() for t in (xs, w, act)))
    # three iterations and their gradients, summed in other orders than the torch code's
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    messages = _warnings(caplog)
    assert messages and all("em_estep_moments pass" in m for m in messages), messages
    assert "illegal memory access" in messages[0]
