"""The poses' LayerNorm as compiled loops (capsctl/layers/passes/pose_norm.py, layer_norm.cpp): the
equation's values and gradients, every thread count, and the torch module wherever the loops
must not run."""

from __future__ import annotations

import pytest
import torch
from conftest import require_native
from torch import nn

from capsctl.layers import dispatch
from capsctl.layers.passes.pose_norm import _PoseLayerNorm, pose_layer_norm

EPS = 1e-5


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b over the last dimension, biased variance, float64."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * w.double() + b.double()


def layer(d: int, seed: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(d, eps=EPS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=g))
        norm.bias.copy_(torch.randn(d, generator=g))
    return norm


@pytest.mark.parametrize(
    "shape",
    [(3, 5, 16), (2, 7, 7, 32, 16), (9000, 16), (4, 33), (6, 1), (1, 16), (300, 5)],
)
@pytest.mark.parametrize("threads", ["1", "2", "3"])
def test_values_and_gradients_match_the_equation(
    shape: tuple[int, ...], threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of 16 (a compile-time length) and others, more rows than one thread's share and
    than the loops' partial sums of the weights' gradients (256 rows)."""
    require_native()
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", threads)
    monkeypatch.setattr("capsctl.layers.backend.bindings.MIN_ROWS_PER_THREAD", 64)
    norm = layer(shape[-1], 1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g).requires_grad_(True)
    gy = torch.randn(*shape, generator=g)
    calls = []
    real = _PoseLayerNorm.apply
    monkeypatch.setattr(_PoseLayerNorm, "apply", lambda *a: calls.append(1) or real(*a))
    y = pose_layer_norm(x, norm)
    y.backward(gy)
    assert calls, "the compiled loops did not run"
    x64 = x.detach().double().requires_grad_(True)
    w64 = norm.weight.detach().double().requires_grad_(True)
    b64 = norm.bias.detach().double().requires_grad_(True)
    want = reference(x64, w64, b64)
    want.backward(gy.double())
    assert torch.allclose(y.double(), want, atol=1e-5)
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-4)
    for got, ref in ((norm.weight.grad, w64.grad), (norm.bias.grad, b64.grad)):
        # a sum over up to 9,000 rows: float32 rounding on the scale of the sum of magnitudes
        scale = max(1.0, ref.abs().max().item())
        assert torch.allclose(got.double(), ref, atol=1e-5 * scale, rtol=1e-5)


def test_the_torch_module_runs_where_the_loops_must_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """float64, export's dense mode, no affine weights, a norm over two dimensions: the module
    itself, with its own results."""

    calls = []
    real = _PoseLayerNorm.apply
    monkeypatch.setattr(_PoseLayerNorm, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 3, 16)
    norm = layer(16, 3)
    assert torch.equal(pose_layer_norm(x.double(), norm.double()), norm(x.double()))
    norm = norm.float()
    with dispatch.use("dense"):
        assert torch.equal(pose_layer_norm(x, norm), norm(x))
    bare = nn.LayerNorm(16, elementwise_affine=False)
    assert torch.equal(pose_layer_norm(x, bare), bare(x))
    two = nn.LayerNorm((3, 16))
    assert torch.equal(pose_layer_norm(x, two), two(x))
    assert torch.equal(pose_layer_norm(x, nn.Identity()), x)
    assert not calls


def test_capsule_layers_normalize_through_the_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The primary capsules' and every capsule layer's LayerNorm of cifar10-caps-simple."""
    require_native()
    from capsctl.config import build_model, resolve_config
    from capsctl.layers.passes.rows_first import _LayoutLayerNorm

    calls = []
    for fn in (_PoseLayerNorm, _LayoutLayerNorm):
        real = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *a, real=real: calls.append(a[0].shape) or real(*a))
    model = build_model(resolve_config("cifar10-caps-simple"))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(calls) >= len(norms) > 1
    assert all(n.weight.grad is not None for n in norms)


def test_under_autocast_bf16_poses_run_the_loops_in_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Autocast's bf16 activations: the loops, in float32 inside, and bf16 out, as autocast's own
    LayerNorm on a CPU returns them."""
    require_native()
    calls = []
    real = _PoseLayerNorm.apply
    monkeypatch.setattr(_PoseLayerNorm, "apply", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(4, 3, 16).bfloat16()
    norm = layer(16, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pose_layer_norm(x, norm)
        want = norm(x)
    assert calls and got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bf16's tolerances
