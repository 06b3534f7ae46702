"""Capsule layers and routing against a naive loop reference written from the equations.

REFERENCE.md §1-2: votes ``V_ij = P_i @ W_ij`` (matrix) or ``W_ij p_i`` (vector); agreement
``<p_j, V_ij> / sqrt(D)``; ``r_ij = softmax over parents j``; ``p_j = LayerNorm(sum_i r_ij V_ij)``;
first pass uniform; concurrent and sequential schedules.
"""

from __future__ import annotations

import math

import pytest
import torch

from capsctl.layers.capsules import ConvCapsules, FCCapsules
from capsctl.layers.routing import RoutedPass, routed_pass, routed_pass_reference
from capsctl.models.capsnet import CapsNet
from capsctl.models.spec import CapsLayerSpec, ModelConfig

TOL = 1e-5


def _vote(pose: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """One vote, straight from the definition. ``pose``: [D_in]; ``w``: [x, c]."""
    if kind == "matrix":
        s = math.isqrt(pose.numel())
        return (pose.view(s, s) @ w).flatten()  # pose on the left, as the authors' code
    return w.t() @ pose  # W p with W stored as [D_in, D_out]


def _randomize_norm(layer: torch.nn.Module) -> None:
    with torch.no_grad():
        layer.norm.weight.normal_()
        layer.norm.bias.normal_()


def naive_fc(layer: FCCapsules, child: torch.Tensor, parent: torch.Tensor | None):
    """Loops over batch, children and parents. ``child``: [b, N, D_in]; ``parent``: [b, M, D]."""
    b, n_in = child.shape[0], layer.in_types
    child = child.reshape(b, n_in, -1)
    m = layer.out_types
    out = torch.zeros(b, m, layer.out_dim, dtype=child.dtype)
    coeff = torch.zeros(b, n_in, m, dtype=child.dtype)
    for bi in range(b):
        for i in range(n_in):
            votes = [_vote(child[bi, i], layer.weight[i, :, j, :], layer.pose) for j in range(m)]
            if parent is None:
                r = [1.0 / m] * m
            else:
                logits = torch.stack(
                    [(parent[bi, j] * votes[j]).sum() * layer.scale for j in range(m)]
                )
                r = list(torch.softmax(logits, 0))
            for j in range(m):
                coeff[bi, i, j] = r[j]
                out[bi, j] += r[j] * votes[j]
    return layer.norm(out), coeff


def naive_conv(layer: ConvCapsules, child: torch.Tensor, parent: torch.Tensor | None):
    """Loops over batch, output positions, kernel offsets, child types and parent types.

    ``child``: [b, H, W, n, D_in]; ``parent``: [b, h, w, m, D]."""
    b, hh, ww, n, _ = child.shape
    k, st, m = layer.kernel, layer.stride, layer.out_types
    h, w = (hh - k) // st + 1, (ww - k) // st + 1
    out = torch.zeros(b, h, w, m, layer.out_dim, dtype=child.dtype)
    coeff = torch.zeros(b, h, w, k, k, n, m, dtype=child.dtype)
    for bi in range(b):
        for y in range(h):
            for x in range(w):
                for ki in range(k):
                    for li in range(k):
                        for i in range(n):
                            pose = child[bi, y * st + ki, x * st + li, i]
                            votes = [
                                _vote(pose, layer.weight[ki, li, i, :, j, :], layer.pose)
                                for j in range(m)
                            ]
                            if parent is None:
                                r = [1.0 / m] * m
                            else:
                                logits = torch.stack(
                                    [
                                        (parent[bi, y, x, j] * votes[j]).sum() * layer.scale
                                        for j in range(m)
                                    ]
                                )
                                r = list(torch.softmax(logits, 0))
                            for j in range(m):
                                coeff[bi, y, x, ki, li, i, j] = r[j]
                                out[bi, y, x, j] += r[j] * votes[j]
    return layer.norm(out), coeff


@pytest.mark.parametrize("pose,din,dout", [("matrix", 4, 4), ("matrix", 9, 9), ("vector", 3, 5)])
def test_fc_layer_matches_naive(pose: str, din: int, dout: int) -> None:
    torch.manual_seed(0)
    layer = FCCapsules(6, din, 4, dout, pose=pose).double()
    _randomize_norm(layer)
    child = torch.randn(2, 6, din, dtype=torch.float64)
    uni = layer.uniform(child)
    ref_uni, _ = naive_fc(layer, child, None)
    assert torch.allclose(uni, ref_uni, atol=TOL)
    parent = torch.randn(2, 4, dout, dtype=torch.float64)
    out, coeff = layer.route(child, parent)
    ref, ref_coeff = naive_fc(layer, child, parent)
    assert torch.allclose(out, ref, atol=TOL)
    assert torch.allclose(coeff, ref_coeff, atol=TOL)


@pytest.mark.parametrize(
    "pose,din,dout,k,stride,size",
    [
        ("matrix", 4, 4, 3, 2, 7),
        ("matrix", 4, 4, 2, 1, 4),
        ("vector", 3, 2, 3, 1, 5),
        ("vector", 2, 4, 1, 1, 3),
    ],
)
def test_conv_layer_matches_naive(
    pose: str, din: int, dout: int, k: int, stride: int, size: int
) -> None:
    torch.manual_seed(1)
    layer = ConvCapsules(3, din, 2, dout, kernel=k, stride=stride, pose=pose).double()
    _randomize_norm(layer)
    child = torch.randn(2, size, size + 1, 3, din, dtype=torch.float64)
    uni = layer.uniform(child)
    ref_uni, ref_uni_coeff = naive_conv(layer, child, None)
    assert uni.shape == ref_uni.shape
    assert torch.allclose(uni, ref_uni, atol=TOL)
    assert torch.allclose(layer.uniform_coefficients(child), ref_uni_coeff)
    parent = torch.randn_like(uni)
    out, coeff = layer.route(child, parent)
    ref, ref_coeff = naive_conv(layer, child, parent)
    assert torch.allclose(out, ref, atol=TOL)
    assert torch.allclose(coeff, ref_coeff, atol=TOL)
    # each child's coefficients sum to one over the parent types, per window
    assert torch.allclose(coeff.sum(-1), torch.ones_like(coeff.sum(-1)), atol=1e-12)


def test_chunked_pass_equals_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    x = torch.randn(7, 11, 2, 2, dtype=torch.float64)
    w = torch.randn(7, 2, 3, 2, dtype=torch.float64)
    p = torch.randn(11, 3, 2, 2, dtype=torch.float64)
    ref_s, ref_r = routed_pass_reference(x, w, p, 0.5)
    import capsctl.layers.routing as routing

    for chunk_bytes in (1, 700, 10**9):
        monkeypatch.setattr(routing, "CHUNK_BYTES", chunk_bytes)
        s, r = routed_pass(x, w, p, 0.5)
        assert torch.allclose(s, ref_s, atol=1e-12)
        assert torch.allclose(r, ref_r, atol=1e-12)


def test_routed_pass_gradcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    import capsctl.layers.routing as routing

    monkeypatch.setattr(routing, "CHUNK_BYTES", 200)  # several chunks
    torch.manual_seed(3)
    x = torch.randn(5, 4, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    p = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, p: RoutedPass.apply(x, w, p, 0.7)[0], (x, w, p))


def test_conv_layer_gradcheck() -> None:
    torch.manual_seed(4)
    layer = ConvCapsules(2, 4, 2, 4, kernel=2, stride=1).double()
    _randomize_norm(layer)
    child = torch.randn(1, 3, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    parent = torch.randn(1, 2, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c, p: layer.route(c, p)[0], (child, parent))


# ---------------------------------------------------------------------------------------------
# Whole models against a naive schedule


def tiny_config(
    pose: str = "matrix", iterations: int = 2, routing: str = "concurrent"
) -> ModelConfig:
    dim = 4 if pose == "matrix" else 3
    return ModelConfig(
        arch="capsnet",
        num_classes=3,
        in_channels=1,
        input_size=10,
        backbone="simple",
        primary_types=2,
        primary_dim=4,
        layers=[
            CapsLayerSpec(kind="conv", types=2, pose_dim=4, kernel=3, stride=1, pose="matrix"),
            CapsLayerSpec(kind="conv", types=2, pose_dim=dim, kernel=2, stride=1, pose=pose),
            CapsLayerSpec(kind="fc", types=2, pose_dim=dim, pose=pose),
        ],
        class_pose=pose,
        iterations=iterations,
        routing=routing,  # type: ignore[arg-type]
    )


def naive_model(model: CapsNet, x: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The schedule of REFERENCE.md §2 with the naive layers and no skipped passes."""
    child = model.primary(model.backbone(x))
    layers = list(model.capsules)
    big_t = model.iterations

    def run(layer, c, p):
        if isinstance(layer, ConvCapsules):
            return naive_conv(layer, c, p)
        return naive_fc(layer, c.reshape(c.shape[0], -1, c.shape[-1]), p)

    coeffs: list[list[torch.Tensor]] = [[] for _ in layers]
    if model.routing == "sequential":
        for i, layer in enumerate(layers):
            parent, co = run(layer, child, None)
            coeffs[i].append(co)
            for _ in range(2, big_t + 1):
                parent, co = run(layer, child, parent)
                coeffs[i].append(co)
            child = parent
        return model.head(child).squeeze(-1), coeffs
    poses = [child]
    for i, layer in enumerate(layers):
        out, co = run(layer, poses[-1], None)
        poses.append(out)
        coeffs[i].append(co)
    for _ in range(2, big_t + 1):
        new = list(poses)
        for i, layer in enumerate(layers):
            new[i + 1], co = run(layer, poses[i], poses[i + 1])
            coeffs[i].append(co)
        poses = new
    return model.head(poses[-1]).squeeze(-1), coeffs


@pytest.mark.parametrize("routing", ["concurrent", "sequential"])
@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_model_matches_naive_schedule(routing: str, iterations: int, pose: str) -> None:
    torch.manual_seed(5)
    model = CapsNet(tiny_config(pose, iterations, routing)).double().eval()
    for layer in model.capsules:
        _randomize_norm(layer)
    x = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    with torch.no_grad():
        ref, ref_coeffs = naive_model(model, x)
        out = model(x)
        out_t, trace = model(x, trace=True)
    assert torch.allclose(out, ref, atol=TOL)
    assert torch.allclose(out_t, ref, atol=TOL)
    assert len(trace.coefficients) == 4
    for got, want in zip(trace.coefficients, ref_coeffs, strict=True):
        assert len(got) == iterations
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, atol=TOL)


def test_coefficients_sum_to_one_and_first_pass_is_uniform() -> None:
    torch.manual_seed(6)
    model = CapsNet(tiny_config(iterations=3)).eval()
    with torch.no_grad():
        _, trace = model(torch.randn(3, 1, 10, 10), trace=True)
    for layer_coeffs in trace.coefficients:
        for t, c in enumerate(layer_coeffs):
            assert torch.allclose(c.sum(-1), torch.ones(()), atol=1e-5)
            m = c.shape[-1]
            if t == 0:
                assert torch.all(c == 1.0 / m)
            else:
                assert not torch.allclose(c, torch.full_like(c, 1.0 / m))


def test_concurrent_equals_sequential_only_at_t1() -> None:
    torch.manual_seed(7)
    x = torch.randn(2, 1, 10, 10)
    model = CapsNet(tiny_config(iterations=1)).eval()
    with torch.no_grad():
        conc = model(x)
        model.set_routing(mode="sequential")
        seq = model(x)
        assert torch.equal(conc, seq)
        model.set_routing(iterations=2, mode="concurrent")
        conc2 = model(x)
        model.set_routing(mode="sequential")
        seq2 = model(x)
    assert not torch.allclose(conc2, seq2, atol=1e-6)


def test_concurrent_skips_only_passes_that_cannot_reach_the_output() -> None:
    """Skipping unreachable passes (the fast path) must not change the logits."""
    torch.manual_seed(8)
    model = CapsNet(tiny_config(iterations=3)).double().eval()
    x = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    with torch.no_grad():
        fast = model(x)
        traced, _ = model(x, trace=True)
    assert torch.allclose(fast, traced, atol=1e-12)


def test_dense_pass_equals_chunked_pass() -> None:
    """The traced (export, compile) formula and the chunked eager pass agree."""
    from capsctl.layers.routing import dense_routing, routed_pass_dense

    torch.manual_seed(9)
    x = torch.randn(6, 5, 2, 2, dtype=torch.float64)
    w = torch.randn(6, 2, 3, 2, dtype=torch.float64)
    p = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    s1, r1 = routed_pass(x, w, p, 0.5)
    s2, r2 = routed_pass_dense(x, w, p, 0.5)
    with dense_routing():
        s3, _ = routed_pass(x, w, p, 0.5)
    assert torch.allclose(s1, s2, atol=1e-12) and torch.allclose(r1, r2, atol=1e-12)
    assert torch.equal(s2, s3)
