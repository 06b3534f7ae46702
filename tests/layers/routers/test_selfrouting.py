"""Self-routing capsule layer: references written from the paper's equations, invariants, the
chunked pass against the dense one, and what the chunked pass keeps for the backward pass.

Hahn, Pyeon, Kim, "Self-Routing Capsule Networks" (NeurIPS 2019), section 3, per parent site,
children ``i`` and parent types ``j``:

- vote ``u_hat_{j|i} = pose_i @ W_ij`` (a pose is a ``rows x x`` matrix, row-major);
- ``c_ij = softmax_j(sum_e u_i[e] W^route_i[e][j] + b^route_ij)``;
- ``a_j = sum_i c_ij a_i / (sum_i a_i + EPS)``;
- ``u_j = sum_i c_ij a_i u_hat_{j|i} / (sum_i c_ij a_i + EPS)``.

A conv site is one output position: its children are the ``k x k`` window of all child types,
at input position ``(h * stride + k, w * stride + l)``. The references loop over plain Python
floats; every constant is typed here.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch

from capsctl.layers import dispatch
from capsctl.layers.routers.selfrouting import SelfRoutingCapsules

EPS = 1e-8  # added to both denominators (a site whose children all have activation 0)
TOL = 1e-5

# --------------------------------------------------------------------------------------------
# Naive reference
# --------------------------------------------------------------------------------------------


def naive_site(
    poses: list[list[float]],
    acts: list[float],
    w: list[list[list[list[float]]]],
    wr: list[list[list[float]]],
    br: list[list[float]],
    rows: int,
) -> tuple[list[list[float]], list[float], list[list[float]]]:
    """One site. ``poses[i]`` (``rows * x`` floats), ``acts[i]``, ``w[i][e][j][q]`` (pose weight
    of child i, parent j: ``x x c``), ``wr[i][e][j]``, ``br[i][j]``.

    Returns parent poses ``[j][rows * c]``, parent activations ``[j]``, coefficients ``[i][j]``.
    """
    n, m = len(poses), len(br[0])
    x, c = len(w[0]), len(w[0][0][0])
    coef = []
    for i in range(n):
        logits = [
            sum(poses[i][e] * wr[i][e][j] for e in range(len(poses[i]))) + br[i][j]
            for j in range(m)
        ]
        top = max(logits)
        ex = [math.exp(v - top) for v in logits]
        coef.append([v / sum(ex) for v in ex])
    out_poses, out_acts = [], []
    for j in range(m):
        mass = sum(coef[i][j] * acts[i] for i in range(n))
        out_acts.append(mass / (sum(acts) + EPS))
        pose = [0.0] * (rows * c)
        for i in range(n):
            for r in range(rows):
                for q in range(c):
                    vote = sum(poses[i][r * x + e] * w[i][e][j][q] for e in range(x))
                    pose[r * c + q] += coef[i][j] * acts[i] * vote / (mass + EPS)
        out_poses.append(pose)
    return out_poses, out_acts, coef


def naive_fc(layer: SelfRoutingCapsules, child: torch.Tensor, act: torch.Tensor):
    w, wr, br = layer.weight.tolist(), layer.route_weight.tolist(), layer.route_bias.tolist()
    return [
        naive_site(child[b].tolist(), act[b].tolist(), w, wr, br, layer.rows)
        for b in range(child.shape[0])
    ]


def naive_conv(layer: SelfRoutingCapsules, child: torch.Tensor, act: torch.Tensor, k: int, s: int):
    """``{(b, h, w): site result}`` with the children ordered ``(k, l, n)``."""
    w, wr, br = layer.weight.tolist(), layer.route_weight.tolist(), layer.route_bias.tolist()
    bsz, hh, ww, n = act.shape
    out = {}
    for b in range(bsz):
        for h in range((hh - k) // s + 1):
            for q in range((ww - k) // s + 1):
                poses, acts, ws, wrs, brs = [], [], [], [], []
                for dk in range(k):
                    for dl in range(k):
                        for t in range(n):
                            poses.append(child[b, h * s + dk, q * s + dl, t].tolist())
                            acts.append(float(act[b, h * s + dk, q * s + dl, t]))
                            ws.append(w[dk][dl][t])
                            wrs.append(wr[dk][dl][t])
                            brs.append(br[dk][dl][t])
                out[(b, h, q)] = naive_site(poses, acts, ws, wrs, brs, layer.rows)
    return out


def _layer(
    kind: str, n: int, d_in: int, m: int, d_out: int, rows: int, **kw
) -> SelfRoutingCapsules:
    torch.manual_seed(0)
    layer = SelfRoutingCapsules(kind, n, d_in, m, d_out, rows=rows, **kw).double()
    with torch.no_grad():  # non-trivial routing (the init is all zero)
        layer.route_weight.normal_(0.0, 0.7)
        layer.route_bias.normal_(0.0, 0.7)
    return layer


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------

FC_CASES = [  # (n, d_in, m, d_out, rows)
    (5, 16, 3, 16, 4),  # 4x4 matrix poses
    (3, 4, 1, 6, 2),  # 2 x 2 -> 2 x 3 matrices, m = 1
    (1, 3, 4, 5, 1),  # vectors, n = 1
]


@pytest.mark.parametrize("n,d_in,m,d_out,rows", FC_CASES)
def test_fc_matches_reference(n: int, d_in: int, m: int, d_out: int, rows: int) -> None:
    layer = _layer("fc", n, d_in, m, d_out, rows)
    child = torch.randn(2, n, d_in, dtype=torch.float64)
    act = torch.rand(2, n, dtype=torch.float64)
    poses, acts, coef = layer.route(child, act)
    assert poses.shape == (2, m, d_out) and acts.shape == (2, m) and coef.shape == (2, n, m)
    for b, (p_ref, a_ref, c_ref) in enumerate(naive_fc(layer, child, act)):
        assert torch.allclose(poses[b], torch.tensor(p_ref, dtype=torch.float64), atol=TOL)
        assert torch.allclose(acts[b], torch.tensor(a_ref, dtype=torch.float64), atol=TOL)
        assert torch.allclose(coef[b], torch.tensor(c_ref, dtype=torch.float64), atol=TOL)


def test_class_layer_without_poses_routes_activations_only() -> None:
    """The class capsules of Hahn et al. are activations only: no pose weights, no poses, and
    the same activations and coefficients as the layer with poses."""
    with_poses = _layer("fc", 5, 16, 3, 16, 4)
    layer = _layer("fc", 5, 16, 3, 16, 4, poses=False)
    assert layer.weight is None and "weight" not in dict(layer.named_parameters())
    layer.load_state_dict({k: v for k, v in with_poses.state_dict().items() if k != "weight"})
    child = torch.randn(2, 5, 16, dtype=torch.float64)
    act = torch.rand(2, 5, dtype=torch.float64)
    poses, acts, coef = layer.route(child, act)
    assert poses is None
    for b, (_, a_ref, c_ref) in enumerate(naive_fc(with_poses, child, act)):
        assert torch.allclose(acts[b], torch.tensor(a_ref, dtype=torch.float64), atol=TOL)
        assert torch.allclose(coef[b], torch.tensor(c_ref, dtype=torch.float64), atol=TOL)


CONV_CASES = [  # (n, d_in, m, d_out, rows, kernel, stride, grid)
    (2, 16, 3, 16, 4, 3, 1, 4),
    (3, 4, 2, 4, 2, 3, 2, 7),
    (1, 3, 1, 2, 1, 2, 2, 5),  # vectors, n = 1, m = 1
]


@pytest.mark.parametrize("n,d_in,m,d_out,rows,k,s,grid", CONV_CASES)
def test_conv_matches_reference(
    n: int, d_in: int, m: int, d_out: int, rows: int, k: int, s: int, grid: int
) -> None:
    layer = _layer("conv", n, d_in, m, d_out, rows, kernel=k, stride=s)
    child = torch.randn(2, grid, grid, n, d_in, dtype=torch.float64)
    act = torch.rand(2, grid, grid, n, dtype=torch.float64)
    poses, acts, coef = layer.route(child, act)
    side = (grid - k) // s + 1
    assert poses.shape == (2, side, side, m, d_out)
    assert acts.shape == (2, side, side, m)
    assert coef.shape == (2, side, side, k, k, n, m)
    ref = naive_conv(layer, child, act, k, s)
    assert len(ref) == 2 * side * side
    for (b, h, w), (p_ref, a_ref, c_ref) in ref.items():
        assert torch.allclose(poses[b, h, w], torch.tensor(p_ref, dtype=torch.float64), atol=TOL)
        assert torch.allclose(acts[b, h, w], torch.tensor(a_ref, dtype=torch.float64), atol=TOL)
        c = torch.tensor(c_ref, dtype=torch.float64).view(k, k, n, m)
        assert torch.allclose(coef[b, h, w], c, atol=TOL)


def test_children_with_zero_activation_give_zero_parents() -> None:
    layer = _layer("conv", 2, 4, 3, 4, 2, kernel=2, stride=1)
    child = torch.randn(1, 3, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    act = torch.zeros(1, 3, 3, 2, dtype=torch.float64, requires_grad=True)
    poses, acts, _ = layer.route(child, act)
    assert torch.equal(poses, torch.zeros_like(poses)) and torch.equal(acts, torch.zeros_like(acts))
    (poses.sum() + acts.sum()).backward()
    assert torch.isfinite(child.grad).all() and torch.isfinite(act.grad).all()


# --------------------------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------------------------


def test_coefficients_sum_to_one_over_parents() -> None:
    layer = _layer("conv", 3, 16, 5, 16, 4, kernel=3, stride=2)
    _, _, coef = layer.route(
        torch.randn(2, 7, 7, 3, 16, dtype=torch.float64),
        torch.rand(2, 7, 7, 3, dtype=torch.float64),
    )
    assert torch.allclose(coef.sum(-1), torch.ones(coef.shape[:-1], dtype=torch.float64))


def test_zero_initialized_routing_is_uniform() -> None:
    torch.manual_seed(0)
    layer = SelfRoutingCapsules("conv", 4, 16, 6, 16, rows=4, kernel=3, stride=1)
    assert torch.count_nonzero(layer.route_weight) == 0
    assert torch.count_nonzero(layer.route_bias) == 0
    expected_std = math.sqrt(6 / (4 * 3 * 3 * 4))  # sqrt(m / (x * J)), J = k * k * n
    assert abs(layer.weight.std().item() - expected_std) < 0.1 * expected_std
    _, acts, coef = layer.route(torch.randn(1, 5, 5, 4, 16), torch.rand(1, 5, 5, 4))
    assert torch.allclose(coef, torch.full_like(coef, 1 / 6))
    # uniform coefficients: every parent gets the mean child activation of its window
    assert torch.allclose(acts, acts[..., :1].expand_as(acts), atol=1e-6)


def test_gradcheck_tiny_conv() -> None:
    layer = _layer("conv", 2, 4, 2, 4, 2, kernel=2, stride=1)
    layer.chunk_sites = 3
    child = torch.randn(1, 3, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    act = (torch.rand(1, 3, 3, 2, dtype=torch.float64) + 0.1).requires_grad_()

    def run(ch, ac, w, wr, br):
        params = {"weight": w, "route_weight": wr, "route_bias": br}
        poses, acts, _ = torch.func.functional_call(layer, params, (ch, ac))
        return poses, acts

    params = [
        p.detach().clone().requires_grad_()
        for p in (layer.weight, layer.route_weight, layer.route_bias)
    ]
    assert torch.autograd.gradcheck(run, (child, act, *params))


def test_gradcheck_class_layer_without_poses() -> None:
    """Only the parent activations depend on the mass here: its gradient arrives broadcast over
    the children (stride 0)."""
    layer = _layer("fc", 4, 4, 3, 4, 2, poses=False)
    child = torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    act = (torch.rand(2, 4, dtype=torch.float64) + 0.1).requires_grad_()

    def run(ch, ac, wr, br):
        params = {"route_weight": wr, "route_bias": br}
        return torch.func.functional_call(layer, params, (ch, ac))[1]

    params = [p.detach().clone().requires_grad_() for p in (layer.route_weight, layer.route_bias)]
    assert torch.autograd.gradcheck(run, (child, act, *params))


def _grads(layer: SelfRoutingCapsules, child, act, dense: bool):
    ctx = dispatch.use("dense") if dense else contextlib.nullcontext()
    with ctx:
        poses, acts, coef = layer.route(child, act)
    gen = torch.Generator().manual_seed(1)
    loss = (poses * torch.randn(poses.shape, generator=gen, dtype=poses.dtype)).sum()
    loss = loss + (acts * torch.randn(acts.shape, generator=gen, dtype=acts.dtype)).sum()
    inputs = [child, act, layer.weight, layer.route_weight, layer.route_bias]
    return [poses, acts, coef, *torch.autograd.grad(loss, inputs)]


@pytest.mark.parametrize("kind", ["conv", "fc"])
def test_chunked_matches_dense(kind: str) -> None:
    if kind == "conv":
        layer = _layer("conv", 3, 16, 4, 16, 4, kernel=3, stride=2)
        child = torch.randn(3, 7, 7, 3, 16, dtype=torch.float64, requires_grad=True)
        act = torch.rand(3, 7, 7, 3, dtype=torch.float64, requires_grad=True)
    else:
        layer = _layer("fc", 6, 5, 3, 5, 1)
        child = torch.randn(7, 6, 5, dtype=torch.float64, requires_grad=True)
        act = torch.rand(7, 6, dtype=torch.float64, requires_grad=True)
    dense = _grads(layer, child, act, dense=True)
    for chunk in (1, 2, 5, None, 1000):
        layer.chunk_sites = chunk
        for got, want in zip(_grads(layer, child, act, dense=False), dense, strict=True):
            assert torch.allclose(got, want, atol=1e-10), chunk


def test_no_grad_matches_grad_pass() -> None:
    layer = _layer("conv", 2, 16, 3, 16, 4, kernel=3, stride=1)
    child, act = (
        torch.randn(2, 4, 4, 2, 16, dtype=torch.float64),
        torch.rand(2, 4, 4, 2, dtype=torch.float64),
    )
    with_grad = layer.route(child, act)
    with torch.no_grad():
        without = layer.route(child, act)
    for a, b in zip(with_grad, without, strict=True):
        assert torch.allclose(a, b, atol=1e-12)


def test_no_vote_sized_tensor_is_saved() -> None:
    torch.manual_seed(0)
    b, grid, n, m, k, s, d = 2, 7, 4, 8, 3, 2, 16
    layer = SelfRoutingCapsules("conv", n, d, m, d, rows=4, kernel=k, stride=s)
    layer.chunk_sites = 2
    side = (grid - k) // s + 1
    votes = b * side * side * m * (k * k * n) * d  # B * m * J * d
    child = torch.randn(b, grid, grid, n, d, requires_grad=True)
    act = torch.rand(b, grid, grid, n, requires_grad=True)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        poses, acts, _ = layer.route(child, act)
    (poses.sum() + acts.sum()).backward()
    assert sizes and max(sizes) < votes // 4, (max(sizes), votes)


def test_autocast_runs_in_float32() -> None:
    layer = SelfRoutingCapsules("fc", 4, 16, 3, 16, rows=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        poses, acts, coef = layer.route(torch.randn(2, 4, 16), torch.rand(2, 4))
    assert poses.dtype == acts.dtype == coef.dtype == torch.float32


@pytest.mark.parametrize("kind", ["conv", "fc"])
def test_child_major_sites_are_the_sites_transposed(kind: str) -> None:
    """The child-major layout the layer routes in holds each site's window, child by child."""
    if kind == "conv":
        layer = _layer("conv", 3, 4, 2, 4, 2, kernel=3, stride=2)
        child = torch.randn(2, 7, 7, 3, 4)
        sites = [(bi, 2 * hi, 2 * wi) for bi in range(2) for hi in range(3) for wi in range(3)]
        want = torch.stack(  # [B, J, d_in]: window (k, l, n) at each site, typed out
            [child[bi, h0 : h0 + 3, w0 : w0 + 3].reshape(9 * 3, 4) for bi, h0, w0 in sites]
        )
    else:
        layer = _layer("fc", 5, 4, 3, 4, 2)
        child = torch.randn(6, 5, 4)
        want = child
    xj, _ = layer.child_sites(child)
    assert xj.is_contiguous() and torch.equal(xj, want.transpose(0, 1))


# -- the primary capsules' BatchNorm (model.router.primary_norm) -------------------------------


def _fast_self(primary_norm: str | None) -> torch.nn.Module:
    from capsctl.config import load_preset
    from capsctl.models import build_model_from_config

    router = (
        "{name: self}" if primary_norm is None else f"{{name: self, primary_norm: {primary_norm}}}"
    )
    return build_model_from_config(
        load_preset("cifar10-caps-fast", [f"model.router={router}"]).model
    )


def test_primary_norm_defaults_to_batch_norm_as_the_authors_code() -> None:
    default, bare = _fast_self(None), _fast_self("none")
    assert isinstance(default.primary.pose_bn, torch.nn.BatchNorm2d)
    assert isinstance(default.primary.act_bn, torch.nn.BatchNorm2d)
    assert isinstance(bare.primary.pose_bn, torch.nn.Identity)
    names = {n for n, _ in bare.named_parameters()}
    assert not any("_bn" in n for n in names)


def test_the_zero_initialized_routing_plateau_and_how_batch_norm_shortens_it() -> None:
    """With routing weights and biases at zero (the authors' init) every class activation is
    exactly 1/10, and nothing below the routing logits gets a gradient: only the routing weights
    learn at first, at a rate proportional to the child poses. Poses under BatchNorm (unit
    variance) give the routing weights a gradient several times larger than the bare 1x1
    convolution's (pose std about 0.38 on the fast backbone)."""
    grads = {}
    for norm in ("none", "batch"):
        torch.manual_seed(0)
        model = _fast_self(norm).train()
        x = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        y = torch.arange(32) % 10
        out = model(x)
        assert torch.allclose(out, torch.full_like(out, math.log(0.1)), atol=1e-6)
        torch.nn.functional.cross_entropy(out, y).backward()
        assert float(model.primary.conv.weight.grad.abs().max()) == 0.0
        grads[norm] = float(model.capsules[0].route_weight.grad.norm())
    assert grads["batch"] > 2.0 * grads["none"] > 0.0


def test_a_stored_self_routing_model_without_the_knob_loads_without_batch_norm(
    tmp_path: Path,
) -> None:
    from capsctl.checkpoint import load_checkpoint, model_tensors, save_checkpoint
    from capsctl.config import load_preset, preset_to_dict

    preset = load_preset("cifar10-caps-fast", ["model.router={name: self, primary_norm: none}"])
    model = _fast_self("none")
    stored = preset_to_dict(preset)
    stored["model"]["router"] = {"name": "self"}  # as written before the knob existed
    path = tmp_path / "old.safetensors"
    save_checkpoint(path, model_tensors(model), {"preset": stored, "classes": list("abcdefghij")})
    loaded, _ = load_checkpoint(path)
    assert isinstance(loaded.primary.pose_bn, torch.nn.Identity)
