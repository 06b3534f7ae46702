"""Routed passes of one layer over one child tensor share its window copy (sequential T >= 3,
dynamic routing): same results, one copy per layer, nothing kept after the layer's routing."""

from __future__ import annotations

import pytest
import torch

from capsctl.layers.capsules import ConvCapsules
from capsctl.models import build_model_from_config
from capsctl.registry import get_config


def _count_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = ConvCapsules._window_copy

    def spy(self: ConvCapsules, child: torch.Tensor):  # noqa: ANN202
        calls.append(1)
        return real(self, child)

    monkeypatch.setattr(ConvCapsules, "_window_copy", spy)
    return calls


def _two_passes(layer: ConvCapsules, child: torch.Tensor, shared: bool) -> torch.Tensor:
    parent = layer.uniform(child)
    if shared:
        with layer.same_children():
            p2, _ = layer.route(child, parent)
            p3, _ = layer.route(child, p2)
    else:
        p2, _ = layer.route(child, parent)
        p3, _ = layer.route(child, p2)
    return p3


def test_shared_windows_give_the_same_poses_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    layer = ConvCapsules(3, 16, 4, 16, kernel=3, stride=1).double()
    child = torch.randn(2, 5, 5, 3, 16, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, 3, 3, 4, 16, dtype=torch.float64)
    results = []
    calls = _count_copies(monkeypatch)
    for shared in (False, True):
        del calls[:]
        out = _two_passes(layer, child, shared)
        grads = torch.autograd.grad((out * probe).sum(), (child, layer.weight))
        results.append((out.detach(), grads, len(calls)))
    (o1, g1, n1), (o2, g2, n2) = results
    assert (n1, n2) == (2, 1)
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-12)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert layer._memo is None  # nothing is kept after the block


@pytest.mark.parametrize(
    ("name", "iterations", "copies"),
    [
        ("cifar10-caps-simple", 3, 2),
        ("cifar10-caps-simple", 2, 2),
        ("cifar10-dynamic-simple", 3, 2),
    ],
)
def test_schedules_copy_each_layers_windows_once(
    name: str, iterations: int, copies: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two conv capsule layers: one window copy each per forward pass, however many routed
    passes they make."""
    torch.manual_seed(0)
    model = build_model_from_config(get_config(name))
    if name.startswith("cifar10-caps"):
        model.set_routing(iterations, "sequential")
    calls = _count_copies(monkeypatch)
    model(torch.randn(2, 3, 32, 32))
    assert len(calls) == copies
