"""Poses held rows-first between capsule layers (capsctl/layers/passes/rows_first.py): the LayerNorm
that reads one layout and writes the other against the equation, the schedule's plan of which
poses travel rows-first, and the network's outputs and gradients unchanged by it."""

from __future__ import annotations

import pytest
import torch
from conftest import require_native
from torch import nn

from capsctl.layers import dispatch
from capsctl.layers.passes.rows_first import _LayoutLayerNorm, layout_layer_norm

EPS = 1e-5


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """Standard ``[b, *grid, n, 16]`` -> rows-first ``[b, 4, *grid, n, 4]``, written out here."""
    k = t.dim()
    split = t.reshape(*t.shape[:-1], 4, 4)  # [b, *grid, n, a, x]
    return split.permute(0, k - 1, *range(1, k - 1), k).contiguous()  # [b, a, *grid, n, x]


def standard_of(t: torch.Tensor) -> torch.Tensor:
    """Rows-first ``[b, 4, *grid, n, 4]`` -> standard ``[b, *grid, n, 16]``."""
    k = t.dim()
    out = t.permute(0, *range(2, k - 1), 1, k - 1)  # [b, *grid, n, a, x]
    return out.reshape(t.shape[0], *t.shape[2:-1], 16)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b over the 16 numbers of each pose, float64."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * w.double() + b.double()


def _norm(seed: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(16, eps=EPS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
        norm.bias.copy_(torch.randn(16, generator=g))
    return norm


@pytest.mark.parametrize("rows_in", [False, True])
@pytest.mark.parametrize("rows_out", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        (3, 5, 5, 32, 16),  # 800 sites: the compiled loops
        (4, 8, 8, 32, 16),  # 2048 sites, 8192 poses: two threads' spans
        (2, 7, 16),  # flat, 7 sites: the layout copies around the torch module
    ],
)
def test_values_and_gradients_in_every_layout(
    shape: tuple[int, ...], rows_in: bool, rows_out: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_native()
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", "2")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 3 + 1
    gy = torch.randn(shape, generator=g)
    norm = _norm(2)
    w = norm.weight.detach().double().requires_grad_(True)
    b = norm.bias.detach().double().requires_grad_(True)
    xr = x.double().requires_grad_(True)
    want = reference(xr, w, b)
    want.backward(gy.double())

    xin = (rows_of(x) if rows_in else x).requires_grad_(True)
    got = layout_layer_norm(xin, norm, rows_in=rows_in, rows_out=rows_out, rows=4)
    got.backward(rows_of(gy) if rows_out else gy)
    assert got.shape == (rows_of(x) if rows_out else x).shape
    assert torch.allclose((standard_of(got) if rows_out else got).double(), want, atol=2e-5)
    gx = standard_of(xin.grad) if rows_in else xin.grad
    assert torch.allclose(gx.double(), xr.grad, atol=2e-5)
    assert torch.allclose(norm.weight.grad.double(), w.grad, rtol=1e-5, atol=1e-4)
    assert torch.allclose(norm.bias.grad.double(), b.grad, rtol=1e-5, atol=1e-4)


def test_the_loops_run_where_sites_fill_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    require_native()
    calls = []
    real = _LayoutLayerNorm.apply
    monkeypatch.setattr(_LayoutLayerNorm, "apply", lambda *a: calls.append(a[4]) or real(*a))
    norm = _norm(0)
    layout_layer_norm(torch.randn(2, 4, 4, 8, 16), norm, rows_in=False, rows_out=True, rows=4)
    layout_layer_norm(torch.randn(2, 3, 3, 3, 16), norm, rows_in=False, rows_out=True, rows=4)
    layout_layer_norm(
        torch.randn(2, 4, 4, 8, 16), nn.Identity(), rows_in=False, rows_out=True, rows=4
    )
    assert calls == [128]  # 27 sites and a norm without weights go the torch way


def _model(name: str, **router: object) -> nn.Module:
    from capsctl.config import build_model, resolve_config

    cfg = resolve_config(name)
    if router:
        cfg = cfg.replace(router={**cfg.router, **router})
    torch.manual_seed(0)
    return build_model(cfg)


def test_plan_of_the_concurrent_schedule() -> None:
    """cifar10-caps-simple: conv 16x16 -> 7x7, conv 7x7 -> 5x5, FC 800 -> 10. At T=2 only the
    class capsules route, so every pose but the class capsules' travels rows-first; at T=3 the
    second conv layer routes too: its children (windows) and its parents (the class capsules'
    children and its own query) go standard."""
    require_native()
    from capsctl.layers.routers.idpa import rows_first_plan

    feats = torch.zeros(1, 128, 16, 16)
    m = _model("cifar10-caps-simple")
    assert rows_first_plan(m.primary, list(m.capsules), 2, feats) == [True, True, True, False]
    assert rows_first_plan(m.primary, list(m.capsules), 3, feats) == [True, False, False, False]
    assert rows_first_plan(m.primary, list(m.capsules), 4, feats) is None
    assert rows_first_plan(m.primary, list(m.capsules), 2, feats.double()) is None
    with dispatch.use("dense"):  # export's plain ops
        assert rows_first_plan(m.primary, list(m.capsules), 2, feats) is None


@pytest.mark.parametrize(
    "name,iterations",
    [("cifar10-caps-simple", 2), ("cifar10-caps-simple", 3), ("cifar10-caps-fast", 2)],
)
def test_network_outputs_and_gradients_unchanged(
    name: str, iterations: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_native()
    import capsctl.layers.routers.idpa as idpa

    m = _model(name, iterations=iterations)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        m.zero_grad()
        out = m(x)
        (out * torch.arange(1.0, 11.0)).sum().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters()]

    out, grads = run()
    monkeypatch.setattr(idpa, "rows_first_plan", lambda *a: None)
    want, want_grads = run()
    assert torch.allclose(out, want, atol=1e-5)
    for g, wg in zip(grads, want_grads, strict=True):
        assert torch.allclose(g, wg, rtol=1e-4, atol=1e-5 * float(wg.abs().max()))


def test_no_layout_copy_between_uniform_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """cifar10-caps-simple at T=2: the primary capsules and both conv layers hand their poses
    on rows-first, so no pose is copied between layouts forward or backward; the only copies
    are the class layer's children into child-major order for its routed pass and their
    gradient back."""
    require_native()
    import capsctl.layers.passes.layout as layout

    copies = []
    real = layout._copy
    monkeypatch.setattr(layout, "_copy", lambda t, dims: copies.append(t.shape) or real(t, dims))
    m = _model("cifar10-caps-simple")
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    assert copies == [(2, 4, 800, 4), (800, 2, 4, 4)]  # [b, a, n, x] -> [n, b, a, x] and back
    copies.clear()
    m.set_routing(mode="sequential")  # the standard layout: copies before the convolutions
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    assert len(copies) >= 2


def test_routed_pass_of_rows_first_children() -> None:
    """A routed pass handed rows-first children (the schedule gives conv layers standard ones;
    any layer takes either) routes the same poses: conv layers through a standard copy, the FC
    layer straight from the rows."""
    m = _model("cifar10-caps-simple")
    g = torch.Generator().manual_seed(4)
    for layer, child_shape in (
        (m.capsules[1], (2, 7, 7, 32, 16)),
        (m.capsules[2], (2, 5, 5, 32, 16)),
    ):
        child = torch.randn(child_shape, generator=g)
        parent = layer.uniform(child)
        want, want_r = layer.route(child, parent)
        got, got_r = layer.route(rows_of(child), parent, rows_in=True)
        assert torch.allclose(got, want, atol=1e-5)
        assert torch.allclose(got_r, want_r, atol=1e-6)
        assert torch.allclose(layer.uniform(rows_of(child), rows_in=True), parent, atol=1e-5)
