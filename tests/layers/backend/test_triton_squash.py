"""Dynamic routing's squash as Triton kernels (capsctl/layers/backend/triton/squash.py), run on
the CPU by Triton's interpreter: ``v = s |s| / (1 + |s|^2)`` (Sabour, Frosst, Hinton, NeurIPS
2017, eq. 1) and its gradient against the equation written here, at a zero capsule, in bf16,
by gradcheck; dynamic routing's layers run it as the kernels; a failing kernel falls back."""

from __future__ import annotations

import logging
import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: the kernels run on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton cannot import (it ships with torch's CUDA wheels)")

from capsctl.layers.algorithm import Capsules, LayerPlan  # noqa: E402
from capsctl.layers.backend import dispatch  # noqa: E402
from capsctl.layers.backend.triton import squash as squash_kernels  # noqa: E402
from capsctl.layers.backend.triton.squash_ops import triton_squash  # noqa: E402
from capsctl.layers.routers.dynamic import DynamicFC, squash  # noqa: E402

F64 = torch.float64


def squash_equation(s: torch.Tensor) -> torch.Tensor:
    """eq. 1: ``|s|^2 / (1 + |s|^2) * s / |s|``, 0 at ``s = 0``."""
    n2 = (s * s).sum(-1, keepdim=True)
    n = torch.where(n2 > 0, n2, 1.0).sqrt()  # |s|, 1 where s = 0 (that branch is not taken)
    return torch.where(n2 > 0, n2 / (1.0 + n2) * s / n, 0.0 * s)


# leading shape, capsule width: several rows a program, 3 entries (padded to 4), one entry,
# rows past a program's block (2048 / 16 = 128 rows)
SHAPES = [((3, 5), 16), ((7,), 3), ((2,), 1), ((130, 2), 16)]


@pytest.mark.parametrize(("lead", "d"), SHAPES, ids=lambda v: str(v))
def test_the_squash_kernels_match_the_equation(lead: tuple[int, ...], d: int) -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(*lead, d, generator=g, dtype=F64) * 2.0
    s.view(-1, d)[0] = 0.0  # a zero capsule: value 0 and gradient 0 (torch's norm at 0)
    got_s, want_s = s.clone().requires_grad_(), s.clone().requires_grad_()
    v = triton_squash(got_s)
    want = squash_equation(want_s)
    torch.testing.assert_close(v, want, rtol=1e-12, atol=1e-14)
    gv = torch.randn(v.shape, generator=g, dtype=F64)
    (got_g,) = torch.autograd.grad(v, got_s, gv)
    (want_g,) = torch.autograd.grad(squash_equation(want_s), want_s, gv)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)
    assert got_g.view(-1, d)[0].abs().max() == 0.0
    # the torch code the kernels stand for, in float32
    s32 = s.float().requires_grad_()
    with dispatch.use("chunked"):
        ref = squash(s32)
    torch.testing.assert_close(triton_squash(s32), ref, rtol=1e-6, atol=1e-7)


def test_the_squash_passes_gradcheck_and_opcheck() -> None:
    s = torch.randn(4, 3, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(triton_squash, (s,))
    x = torch.randn(4, 3, 5, requires_grad=True)
    torch.library.opcheck(torch.ops.capsctl.triton_squash.default, (x,))
    args = (x.detach(), torch.randn(4, 3, 5))
    torch.library.opcheck(torch.ops.capsctl.triton_squash_backward.default, args)


def test_bf16_capsules_are_squashed_in_float32() -> None:
    s = torch.randn(6, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    v = triton_squash(s)
    assert v.dtype == torch.bfloat16
    # float32 sums of the bf16 values, converted once to bf16: within one bf16 step (2^-7
    # relative: 7 stored mantissa bits) of the exact value
    want = squash_equation(s.double())
    assert ((v.double() - want).abs() <= want.abs() * 2.0**-7).all()


def test_dynamic_routing_squashes_with_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from capsctl.layers.backend.triton import aot as gpu_aot
    from capsctl.layers.routers import dynamic

    def no_torch_norm(*args: object, **kwargs: object) -> None:
        raise AssertionError("the torch squash ran where the Triton kernels run")

    torch.manual_seed(0)
    layer = DynamicFC(LayerPlan("fc", 6, 8, 3, 4, "vector"))
    child = torch.randn(2, 6, 8, requires_grad=True)  # [b, n, d_in]
    monkeypatch.setattr(dynamic.torch.linalg, "vector_norm", no_torch_norm)
    with gpu_aot.capturing() as launches:
        out = layer(Capsules(child), 3)
        out.capsules.poses.sum().backward()
    kernels = [launch.kernel for launch in launches]
    assert kernels.count("squash_forward") == 3 and kernels.count("squash_backward") == 3


def test_a_failing_squash_kernel_falls_back_to_the_torch_code(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Failing:
        def __getitem__(self, grid: object):  # type: ignore[no-untyped-def]
            def launch(*args: object, **kwargs: object) -> None:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            return launch

    monkeypatch.setattr(dispatch, "_FUSED_FAILED", {})
    monkeypatch.setattr(dispatch, "_FUSED_PROVEN", set())
    monkeypatch.setattr(squash_kernels, "squash_backward", Failing())
    s = torch.randn(5, 16, requires_grad=True)
    with caplog.at_level(logging.WARNING), dispatch.use("triton"):
        v = squash(s)
        (g,) = torch.autograd.grad(v.sum(), s)
    ref_s = s.detach().clone().requires_grad_()
    want = squash_equation(ref_s)
    (want_g,) = torch.autograd.grad(want.sum(), ref_s)
    torch.testing.assert_close((v, g), (want, want_g))
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1 and "squash pass" in messages[0], messages
