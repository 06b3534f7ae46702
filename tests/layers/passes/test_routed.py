"""Capsule layers and routing against a naive loop reference written from the equations.

Tsai, Srivastava, Goh, Salakhutdinov, "Capsules with Inverted Dot-Product Attention Routing"
(ICLR 2020, arXiv:2002.04764), as the authors' code computes it: votes ``V_ij = P_i @ W_ij``
(matrix) or ``W_ij p_i`` (vector); agreement ``<p_j, V_ij> / sqrt(D)``; ``r_ij = softmax over
parents j``; ``p_j = LayerNorm(sum_i r_ij V_ij)``; first pass uniform; concurrent and sequential
schedules.
"""

from __future__ import annotations

import math

import pytest
import torch

from capsctl.layers.algorithm import Capsules
from capsctl.layers.backend.dispatch import choose
from capsctl.layers.capsules import ConvCapsules, FCCapsules
from capsctl.layers.passes.routed import ChunkedRoutedPass, routed_pass, routed_pass_reference
from capsctl.models.capsnet import CapsNet
from capsctl.models.spec import CapsLayerSpec, ModelConfig

TOL = 1e-5
LN_EPS = 1e-5  # torch.nn.LayerNorm's default, as in the authors' code


def _layer_norm(v: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the D pose entries of ``v[..., D]``, written out (biased variance)."""
    mean = v.mean(-1, keepdim=True)
    var = ((v - mean) ** 2).mean(-1, keepdim=True)
    return (v - mean) / torch.sqrt(var + LN_EPS) * gain + bias


def _agreement_scale(parent_pose: torch.Tensor) -> float:
    """``1 / sqrt(D)`` of the agreement, D taken from the parent pose itself."""
    return 1.0 / math.sqrt(parent_pose.numel())


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
                    [
                        (parent[bi, j] * votes[j]).sum() * _agreement_scale(parent[bi, j])
                        for j in range(m)
                    ]
                )
                r = list(torch.softmax(logits, 0))
            for j in range(m):
                coeff[bi, i, j] = r[j]
                out[bi, j] += r[j] * votes[j]
    return _layer_norm(out, layer.norm.weight, layer.norm.bias), coeff


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
                                        (parent[bi, y, x, j] * votes[j]).sum()
                                        * _agreement_scale(parent[bi, y, x, j])
                                        for j in range(m)
                                    ]
                                )
                                r = list(torch.softmax(logits, 0))
                            for j in range(m):
                                coeff[bi, y, x, ki, li, i, j] = r[j]
                                out[bi, y, x, j] += r[j] * votes[j]
    return _layer_norm(out, layer.norm.weight, layer.norm.bias), coeff


@pytest.mark.parametrize(
    "pose,n,din,m,dout",
    [
        ("matrix", 6, 4, 4, 4),
        ("matrix", 6, 9, 4, 9),
        ("vector", 6, 3, 4, 5),
        # one child type, one parent type, both
        ("matrix", 1, 4, 3, 4),
        ("matrix", 6, 4, 1, 4),
        ("matrix", 1, 9, 1, 9),
        ("vector", 1, 3, 4, 5),
        ("vector", 6, 3, 1, 5),
        ("vector", 1, 2, 1, 3),
    ],
)
def test_fc_layer_matches_naive(pose: str, n: int, din: int, m: int, dout: int) -> None:
    torch.manual_seed(0)
    layer = FCCapsules(n, din, m, dout, pose=pose).double()
    _randomize_norm(layer)
    child = torch.randn(2, n, din, dtype=torch.float64)
    uni = layer.uniform(child)
    ref_uni, _ = naive_fc(layer, child, None)
    assert torch.allclose(uni, ref_uni, atol=TOL)
    parent = torch.randn(2, m, dout, dtype=torch.float64)
    out, coeff = layer.route(child, parent)
    ref, ref_coeff = naive_fc(layer, child, parent)
    assert torch.allclose(out, ref, atol=TOL)
    assert torch.allclose(coeff, ref_coeff, atol=TOL)


@pytest.mark.parametrize(
    "pose,n,din,m,dout,k,stride,size",
    [
        ("matrix", 3, 4, 2, 4, 3, 2, 7),
        ("matrix", 3, 4, 2, 4, 2, 1, 4),
        ("vector", 3, 3, 2, 2, 3, 1, 5),
        ("vector", 3, 2, 2, 4, 1, 1, 3),
        # one child type, one parent type, both
        ("matrix", 1, 4, 3, 4, 2, 1, 4),
        ("matrix", 3, 4, 1, 4, 2, 1, 4),
        ("matrix", 1, 4, 1, 4, 3, 2, 5),
        ("vector", 1, 3, 2, 2, 2, 1, 4),
        ("vector", 3, 3, 1, 2, 2, 1, 4),
        ("vector", 1, 2, 1, 3, 3, 1, 4),
    ],
)
def test_conv_layer_matches_naive(
    pose: str, n: int, din: int, m: int, dout: int, k: int, stride: int, size: int
) -> None:
    torch.manual_seed(1)
    layer = ConvCapsules(n, din, m, dout, kernel=k, stride=stride, pose=pose).double()
    _randomize_norm(layer)
    child = torch.randn(2, size, size + 1, n, din, dtype=torch.float64)
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


def test_primary_capsules_hand_back_a_gradient_in_their_inputs_layout() -> None:
    """The features go channels-last into the 1x1 convolution; their gradient must come back
    contiguous like them (an element-wise backward over two layouts is several times slower)."""
    from capsctl.layers.primary import PrimaryCapsules

    leaf = torch.randn(2, 8, 5, 5, requires_grad=True)
    feats = torch.relu(leaf)  # not a leaf: its gradient is what the backward pass produced
    seen: list[torch.Tensor] = []
    feats.register_hook(seen.append)
    PrimaryCapsules(8, 4, 16)(feats).square().sum().backward()
    assert len(seen) == 1 and seen[0].is_contiguous()
    frozen = torch.randn(2, 8, 5, 5)  # no gradient: a plain copy
    assert PrimaryCapsules(8, 4, 16)(frozen).shape == (2, 5, 5, 4, 16)


def test_the_uniform_pass_convolves_with_a_dense_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight in no dense layout is copied by the convolution itself, element by element,
    in the forward and again in the backward pass; the layer hands it over transposed once."""
    import torch.nn.functional as F

    seen: list[torch.Tensor] = []
    conv2d = F.conv2d

    def spy(inp, weight, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(weight)
        return conv2d(inp, weight, *args, **kwargs)

    monkeypatch.setattr(F, "conv2d", spy)
    layer = ConvCapsules(3, 16, 4, 16, kernel=3, stride=2, pose="matrix")
    layer.uniform(torch.randn(2, 7, 7, 3, 16)).sum().backward()
    assert len(seen) == 1
    assert seen[0].is_contiguous(memory_format=torch.channels_last)
    assert layer.weight.grad is not None


def test_chunked_pass_equals_unchunked(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    x = torch.randn(7, 11, 2, 2, dtype=torch.float64)
    w = torch.randn(7, 2, 3, 2, dtype=torch.float64)
    p = torch.randn(11, 3, 2, 2, dtype=torch.float64)
    ref_s, ref_r = routed_pass_reference(x, w, p, 0.5)
    from capsctl.layers.backend import chunks

    for chunk_bytes in (1, 700, 10**9):
        monkeypatch.setattr(chunks, "CHUNK_BYTES", chunk_bytes)
        s, r = routed_pass(x, w, p, 0.5)
        assert torch.allclose(s, ref_s, atol=1e-12)
        assert torch.allclose(r, ref_r, atol=1e-12)


def test_routed_pass_gradcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    from capsctl.layers.backend import chunks

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 200)  # several chunks
    torch.manual_seed(3)
    x = torch.randn(5, 4, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    p = torch.randn(4, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, p: ChunkedRoutedPass.apply(x, w, p, 0.7, choose(x, w, p))[0], (x, w, p)
    )


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
        router={"name": "idpa", "iterations": iterations, "schedule": routing},
    )


def naive_model(model: CapsNet, x: torch.Tensor) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The concurrent or sequential schedule (Tsai et al. 2020) with the naive layers and no
    skipped passes."""
    child = model.primary(model.backbone(x)).poses
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
        return model.head(Capsules(child)), coeffs
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
    return model.head(Capsules(poses[-1])), coeffs


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
    from capsctl.layers import dispatch
    from capsctl.layers.passes.routed import routed_pass_dense

    torch.manual_seed(9)
    x = torch.randn(6, 5, 2, 2, dtype=torch.float64)
    w = torch.randn(6, 2, 3, 2, dtype=torch.float64)
    p = torch.randn(5, 3, 2, 2, dtype=torch.float64)
    s1, r1 = routed_pass(x, w, p, 0.5)
    s2, r2 = routed_pass_dense(x, w, p, 0.5)
    with dispatch.use("dense"):
        s3, _ = routed_pass(x, w, p, 0.5)
    assert torch.allclose(s1, s2, atol=1e-12) and torch.allclose(r1, r2, atol=1e-12)
    assert torch.equal(s2, s3)


# ---------------------------------------------------------------------------------------------
# The routed pass never modifies its inputs (one parent type shares storage with its layouts)


def _layer_and_poses(
    kind: str, pose: str, m: int
) -> tuple[FCCapsules | ConvCapsules, torch.Tensor, torch.Tensor]:
    """A float64 layer with ``m`` parent types, child poses and parent poses to route."""
    din, dout = (4, 4) if pose == "matrix" else (3, 2)
    if kind == "fc":
        layer = FCCapsules(5, din, m, dout, pose=pose).double()
        child = torch.randn(3, 5, din, dtype=torch.float64)  # [b, n, D_in]
        parent = torch.randn(3, m, dout, dtype=torch.float64)  # [b, m, D]
    else:
        layer = ConvCapsules(2, din, m, dout, kernel=2, stride=1, pose=pose).double()
        child = torch.randn(2, 4, 5, 2, din, dtype=torch.float64)  # [b, H, W, n, D_in]
        parent = torch.randn(2, 3, 4, m, dout, dtype=torch.float64)  # [b, h, w, m, D]
    _randomize_norm(layer)
    return layer, child, parent


def _assert_unchanged(inputs: dict[str, torch.Tensor], before: dict[str, torch.Tensor], when: str):
    for name, t in inputs.items():
        assert torch.equal(t.detach(), before[name]), f"{name} modified by the {when}"


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("pose", ["matrix", "vector"])
@pytest.mark.parametrize("kind", ["fc", "conv"])
def test_layer_route_never_modifies_its_inputs(kind: str, pose: str, m: int, grad: bool) -> None:
    torch.manual_seed(10)
    layer, child, parent = _layer_and_poses(kind, pose, m)
    child.requires_grad_(grad)
    parent.requires_grad_(grad)
    layer.weight.requires_grad_(grad)
    inputs = {"child poses": child, "parent poses": parent, "weights": layer.weight}
    before = {name: t.detach().clone() for name, t in inputs.items()}
    with torch.set_grad_enabled(grad):
        out, _ = layer.route(child, parent)
    _assert_unchanged(inputs, before, "forward")
    if grad:
        out.backward(torch.randn_like(out))
        _assert_unchanged(inputs, before, "backward")


def _pass_inputs(m: int, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x[J, B, a, x]``, ``w[J, x, m, c]``, ``p[B, m, a, c]`` (float64), either contiguous or
    as views of storage laid out the way the routed pass works (sites major, parent type
    innermost), which a copy to that layout would alias."""
    j, bsz, a, xd, c = 5, 4, 2, 3, 2
    if layout == "contiguous":
        x = torch.randn(j, bsz, a, xd, dtype=torch.float64)
        w = torch.randn(j, xd, m, c, dtype=torch.float64)
        p = torch.randn(bsz, m, a, c, dtype=torch.float64)
    else:
        x = torch.randn(bsz, j, a, xd, dtype=torch.float64).transpose(0, 1)  # [J, B, a, x]
        w = torch.randn(j, xd, c, m, dtype=torch.float64).permute(0, 1, 3, 2)  # [J, x, m, c]
        p = torch.randn(bsz, a, c, m, dtype=torch.float64).permute(0, 3, 1, 2)  # [B, m, a, c]
    return x, w, p


@pytest.mark.parametrize("layout", ["contiguous", "site-major"])
@pytest.mark.parametrize("m", [1, 3])
def test_routed_pass_never_modifies_its_inputs(
    m: int, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from capsctl.layers.backend import chunks

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 200)  # several chunks
    torch.manual_seed(11)
    x, w, p = _pass_inputs(m, layout)
    inputs = {"child poses": x, "weights": w, "parent poses": p}
    before = {name: t.clone() for name, t in inputs.items()}
    routed_pass(x, w, p, 0.5)  # no autograd
    _assert_unchanged(inputs, before, "forward without autograd")
    for t in inputs.values():
        t.requires_grad_(True)
    s, _ = routed_pass(x, w, p, 0.5)
    _assert_unchanged(inputs, before, "forward")
    s.backward(torch.randn_like(s))
    _assert_unchanged(inputs, before, "backward")
    # and the result is right for these inputs
    ref_s, _ = routed_pass_reference(
        before["child poses"], before["weights"], before["parent poses"], 0.5
    )
    assert torch.allclose(s, ref_s, atol=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "site-major"])
@pytest.mark.parametrize("m", [1, 3])
def test_routed_pass_gradcheck_in_any_layout(m: int, layout: str) -> None:
    torch.manual_seed(12)
    x, w, p = (t.requires_grad_(True) for t in _pass_inputs(m, layout))
    assert torch.autograd.gradcheck(
        lambda x, w, p: ChunkedRoutedPass.apply(x, w, p, 0.7, choose(x, w, p))[0], (x, w, p)
    )


def one_type_config(pose: str, fc_after: bool) -> ModelConfig:
    """tiny_config at T=3 concurrent whose second capsule layer has one type (m = 1); its
    parent poses are the child poses of the next layer (an FC layer or the class capsules)."""
    cfg = tiny_config(pose, 3, "concurrent")
    cfg.layers[1].types = 1
    if not fc_after:
        del cfg.layers[2]
    return cfg


@pytest.mark.parametrize("fc_after", [False, True])
@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_model_with_a_one_type_layer_matches_naive_schedule(pose: str, fc_after: bool) -> None:
    torch.manual_seed(13)
    model = CapsNet(one_type_config(pose, fc_after)).double().eval()
    for layer in model.capsules:
        _randomize_norm(layer)
    x = torch.randn(2, 1, 10, 10, dtype=torch.float64)
    g = torch.randn(2, 3, dtype=torch.float64)
    ref, _ = naive_model(model, x)
    ref_grads = torch.autograd.grad((ref * g).sum(), list(model.capsules.parameters()))
    out = model(x)
    grads = torch.autograd.grad((out * g).sum(), list(model.capsules.parameters()))
    with torch.no_grad():
        out_nograd = model(x)
        out_t, _ = model(x, trace=True)
    assert torch.allclose(out, ref, atol=TOL)
    assert torch.allclose(out_nograd, ref, atol=TOL)
    assert torch.allclose(out_t, ref, atol=TOL)
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.allclose(got, want, atol=TOL)
